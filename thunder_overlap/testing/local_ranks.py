"""Run a function on N local ranks (processes) with a process group, collecting the results.

Used by the demo, the tests and the CPU benchmarks. Errors on any rank are raised in the caller
with that rank's traceback; a rank that dies or a run past ``timeout_s`` never hangs the caller.
Each rank's standard output (native code's too: gloo writes there in pieces, so two ranks' lines
would interleave mid-line) goes to a file of its own, and the caller writes the files to its own
standard output one rank after the other when the ranks are done.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["NO_RANKS_ENV", "refuse_if_ranks_forbidden", "run_local_ranks"]

# Set (to a test's name) by tests/conftest.py while a test not marked ``ranks`` runs: starting
# ranks then, in that process or a child (the demo), is an error naming the test.
NO_RANKS_ENV = "THUNDER_OVERLAP_NO_RANKS"


def refuse_if_ranks_forbidden(what: str) -> None:
    test = os.environ.get(NO_RANKS_ENV)
    if test:
        raise RuntimeError(
            f"{test} starts {what} but is not marked `ranks`, so make test-fast would run it: "
            "mark the test (or its module: pytestmark = pytest.mark.ranks)"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, backend, args, results, timeout_s, output_path) -> None:
    import torch.distributed as dist

    # A rank killed by a signal (a crash in native code) leaves no Python traceback for the
    # parent to raise; this writes every thread's stack to standard error first.
    faulthandler.enable(all_threads=True)
    sys.stdout.flush()
    output = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.close(output)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        # Pickled here, by value: torch would otherwise share tensors through file descriptors
        # that vanish when this process exits.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_ranks(
    fn: Callable[..., Any], world_size: int = 2, args: tuple = (), *, backend: str = "gloo", timeout_s: float = 600
) -> list[Any]:
    """Calls ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; returns the
    results ordered by rank. ``fn`` and its results must be picklable."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    refuse_if_ranks_forbidden(f"{world_size} local ranks")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    output_dir = tempfile.TemporaryDirectory(prefix="thunder_overlap_ranks_")
    outputs = [os.path.join(output_dir.name, f"rank{rank}.out") for rank in range(world_size)]
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, backend, args, results, timeout_s, outputs[rank]), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue_module.Empty:
                crashed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in collected]
                if crashed:
                    codes = ", ".join(_exit_status(procs[i].exitcode) for i in crashed)
                    raise RuntimeError(f"ranks {crashed} exited: {codes} (any stack faulthandler wrote is in standard error)") from None
                if time.monotonic() > deadline:
                    late = sorted(set(range(world_size)) - set(collected))
                    raise TimeoutError(f"ranks {late} did not finish within {timeout_s}s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}{_dead_peers(procs, rank)}")
            collected[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        _forward_outputs(outputs)
        output_dir.cleanup()
    return [collected[r] for r in range(world_size)]


def _exit_status(code: int | None) -> str:
    """A process's exit code in words: killed by a signal where it is negative."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _dead_peers(procs: list, failed_rank: int, grace_s: float = 5.0) -> str:
    """Which other ranks died, for the error of a rank that failed: a rank that loses its peer
    mid-collective fails with only "Connection reset by peer", and the cause is the peer's death
    (a signal from native code, the OOM killer), which leaves no traceback of its own."""
    deadline = time.monotonic() + grace_s
    others = [i for i in range(len(procs)) if i != failed_rank]
    while time.monotonic() < deadline and not all(procs[i].exitcode is not None for i in others):
        time.sleep(0.1)
    dead = [f"rank {i}: {_exit_status(procs[i].exitcode)}" for i in others if procs[i].exitcode not in (None, 0)]
    return f"\n(meanwhile {'; '.join(dead)})" if dead else ""


def _forward_outputs(paths: list[str], fd: int = 1) -> None:
    """Writes each rank's captured output to this process's ``fd`` (standard output, or standard
    error with 2), one rank after another."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    for path in paths:
        if os.path.exists(path):
            with open(path, "rb") as captured:
                data = memoryview(captured.read())
            while data:  # os.write may write less than asked into a pipe
                data = data[os.write(fd, data) :]
