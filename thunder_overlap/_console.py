"""What the command-line tools print: third-party chatter filtered, progress on stderr.

Only messages known to be noise are dropped, each matched by its exact start; everything else
(real errors and warnings included) passes through untouched. The library drops only
:data:`KNOWN_WARNINGS` while Thunder imports (:func:`known_warnings_ignored`, once
``thunder_overlap`` is imported) and :data:`KNOWN_OUTPUT` while it creates a process group itself;
the rest is for ``python -m thunder_overlap`` commands.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "KNOWN_OUTPUT",
    "KNOWN_WARNINGS",
    "Heartbeat",
    "children_without_known_warnings",
    "filter_known_output",
    "known_warnings_ignored",
    "without_known_output",
    "progress",
    "silence_known_warnings",
    "warnings_env_for_children",
]


@dataclass(frozen=True)
class KnownWarning:
    """A third-party warning that says nothing to a user of these commands."""

    message_start: str  # matched against the start of the message, as ``-W`` does
    category: type[Warning]
    why: str


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        "transformer_engine module not found!",
        UserWarning,
        "Thunder 0.2.6 warns at import in every process when the optional TransformerEngine is absent",
    ),
)

# Messages that native code of a dependency writes straight to the stdout file descriptor.
# gloo prints one per rank and process group when its connections are up (torch 2.9.1; no
# environment variable or log level turns it off). It writes each message in pieces, so two
# ranks' messages arrive interleaved, one inside the other: they are removed from the whole
# text, innermost first, not line by line.
KNOWN_OUTPUT: tuple[re.Pattern[str], ...] = (
    re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+\n?"),
)

# Seconds to wait for the pipe's last bytes once the block ends; only a child still alive
# (holding the pipe) past the block could make it wait that long.
FILTER_DRAIN_S = 30.0
# Seconds between "still working" lines while a long step runs.
HEARTBEAT_S = 15.0


def silence_known_warnings() -> None:
    """Ignores :data:`KNOWN_WARNINGS` in this process (call before importing thunder)."""
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(known.message_start), category=known.category)


@contextlib.contextmanager
def known_warnings_ignored() -> Iterator[None]:
    """Ignores :data:`KNOWN_WARNINGS` inside the block, and nothing else: a warning given after
    the block, or any other warning, still shows. The package wraps Thunder's import in it."""
    with warnings.catch_warnings():
        silence_known_warnings()
        yield


def warnings_env_for_children() -> str:
    """A ``PYTHONWARNINGS`` value that ignores :data:`KNOWN_WARNINGS` in spawned processes, which
    import thunder while unpickling their task, before any code of ours could install a filter."""
    specs = [f"ignore:{known.message_start}:{known.category.__name__}" for known in KNOWN_WARNINGS]
    inherited = os.environ.get("PYTHONWARNINGS")
    return ",".join([inherited, *specs] if inherited else specs)


@contextlib.contextmanager
def children_without_known_warnings() -> Iterator[None]:
    """Processes spawned inside the block ignore :data:`KNOWN_WARNINGS`."""
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = warnings_env_for_children()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = saved


def without_known_output(text: str) -> str:
    """``text`` less every :data:`KNOWN_OUTPUT` message, nested ones included. Whatever is not a
    whole known message stays, so an unknown line is never lost."""
    previous = None
    while previous != text:
        previous = text
        for pattern in KNOWN_OUTPUT:
            text = pattern.sub("", text)
    return text


@contextlib.contextmanager
def filter_known_output(fd: int = 1) -> Iterator[None]:
    """Drops :data:`KNOWN_OUTPUT` written to file descriptor ``fd`` inside the block, by this
    process or by processes it starts there (they inherit the descriptor).

    The descriptor is pointed at a pipe; what arrives there is written out, filtered, when the
    block ends (messages of several processes can only be told apart once they are complete).
    Native code writes below Python's ``sys.stdout``, so filtering there would miss it.
    """
    stream = sys.stdout if fd == 1 else sys.stderr if fd == 2 else None
    if stream is not None:
        stream.flush()
    try:
        original = os.dup(fd)
    except OSError:  # no such descriptor (a process started with it closed): nothing to filter
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)
    received = bytearray()

    def drain() -> None:
        # Reading while the block runs keeps writers from blocking on a full pipe.
        with os.fdopen(read_end, "rb") as pipe:
            for chunk in iter(lambda: pipe.read1(1 << 16), b""):
                received.extend(chunk)

    thread = threading.Thread(target=drain, name=f"filter-fd-{fd}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        if stream is not None:
            stream.flush()
        # Restoring the descriptor closes this process's last write end; the pipe ends once
        # every child that inherited one has exited too.
        os.dup2(original, fd)
        thread.join(FILTER_DRAIN_S)
        kept = without_known_output(received.decode(errors="replace"))
        os.write(original, kept.encode())
        os.close(original)


def progress(message: str) -> None:
    """A progress line on stderr, so stdout stays the result."""
    print(message, file=sys.stderr, flush=True)


class Heartbeat:
    """Prints the elapsed seconds every :data:`HEARTBEAT_S` while a long step runs."""

    def __init__(self, what: str, interval_s: float = HEARTBEAT_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.what = what
        self.interval_s = interval_s
        self.elapsed_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._start = 0.0

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            progress(f"  ... {self.what}: {time.perf_counter() - self._start:.0f} s")

    def __enter__(self) -> Heartbeat:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.elapsed_s = time.perf_counter() - self._start
