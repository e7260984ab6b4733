"""Rank processes started once and reused: many functions run on the same N local ranks.

``run_local_ranks`` spawns N fresh processes per call, and each imports torch and Thunder again
(seconds of CPU per rank). A ``RankSession`` starts its ranks once (torch, Thunder and
thunder_overlap imported, the process group initialised) and runs each function sent to it on
every rank, returning the results ordered by rank, with ``run_local_ranks``'s reporting: a rank's
exception is raised here with its traceback, naming the rank; a rank that dies is named with its
signal (the stack faulthandler wrote follows the run on standard error); a run past its timeout raises
TimeoutError. After a failure of any kind the ranks are stopped, and the next run starts fresh
ones: a run that failed may have left a collective half done, which would pair with the next
run's collectives. Each run's standard output and standard error are written to this process's
after the run, one rank after another, as ``run_local_ranks`` does for standard output: the
process that runs the session, not the one that started the ranks, sees them (pytest's capture).

Functions sent must be picklable (module-level) and must not leave state behind that changes
another function's results: each builds its own model and sets its own seeds; a function that
patches something restores it.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib
import itertools
import os
import pickle
import queue as queue_module
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

from thunder_overlap.testing.local_ranks import _dead_peers, _exit_status, _forward_outputs, _free_port, refuse_if_ranks_forbidden

__all__ = ["RankSession", "RankSessions", "collect_garbage_rarely"]

# What every rank imports before its process group starts: what nearly every function sent needs.
PRELOAD = ("torch", "thunder", "thunder_overlap", "thunder_overlap.testing.training")
_READY = -1

# Python's collector runs a young-generation pass every 700 net allocations. Thunder's tracing
# allocates containers by the million, so with that default a compile spends a sixth of its CPU
# in the collector. The test suite's processes, which compile model after model (a session's
# ranks, pytest's workers), collect every 50,000 allocations. The library, its commands and the
# benchmarks leave the collector alone: a training process's settings are its owner's.
GC_THRESHOLDS = (50_000, 20, 100)


def collect_garbage_rarely() -> None:
    """Raises this process's collector thresholds to ``GC_THRESHOLDS``."""
    gc.set_threshold(*GC_THRESHOLDS)


def _redirect_outputs(prefix: str) -> None:
    """Standard output to ``prefix.out``, standard error (faulthandler's stacks too) to
    ``prefix.err``, after flushing what was written so far."""
    for stream, fd, suffix in ((sys.stdout, 1, "out"), (sys.stderr, 2, "err")):
        stream.flush()
        output = os.open(f"{prefix}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(output, fd)
        os.close(output)


def _output_paths(directory: str, name: str, world_size: int, suffix: str) -> list[str]:
    return [os.path.join(directory, f"{name}.rank{rank}.{suffix}") for rank in range(world_size)]


def _serve(rank, world_size, port, backend, group_timeout_s, preload, jobs, results, output_dir) -> None:
    """A rank: imports, joins the process group, then runs each job until it gets None."""
    faulthandler.enable(all_threads=True)  # writes to file descriptor 2, wherever it points then
    collect_garbage_rarely()
    idle_output = os.path.join(output_dir, f"idle.rank{rank}")
    _redirect_outputs(idle_output)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    for module in preload:
        importlib.import_module(module)
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=group_timeout_s))
    results.put((_READY, rank, True, b""))
    try:
        while (job := jobs.get()) is not None:
            job_id, payload = job
            _redirect_outputs(os.path.join(output_dir, f"job{job_id}.rank{rank}"))
            try:
                fn, args = pickle.loads(payload)
                # Pickled here, by value: torch would otherwise share tensors through file
                # descriptors that vanish when this process exits.
                outcome = (True, pickle.dumps(fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
                outcome = (False, traceback.format_exc())
            _redirect_outputs(idle_output)  # flushes the job's output into its files first
            results.put((job_id, rank, *outcome))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Stopped as asked: the interpreter's teardown (a second or more in a process holding torch,
    # Thunder and every model it compiled, which a session stops at the end of the tests) has
    # nothing left to do for the session, so it is skipped.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankSession:
    """``world_size`` local ranks, started on the first ``run`` and again after a failure."""

    def __init__(
        self, world_size: int = 2, *, backend: str = "gloo", start_timeout_s: float = 300, group_timeout_s: float = 1800,
        preload: Sequence[str] = PRELOAD,
    ) -> None:  # fmt: skip
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.backend, self.preload = world_size, backend, tuple(preload)
        self.start_timeout_s, self.group_timeout_s = start_timeout_s, group_timeout_s
        # How many times ranks were started (a failure stops them; the next run starts new ones).
        self.starts = 0
        self._procs: list | None = None
        self._job_ids = itertools.count()

    @property
    def alive(self) -> bool:
        return self._procs is not None

    def run(self, fn: Callable[..., Any], args: tuple = (), *, timeout_s: float = 600) -> list[Any]:
        """Calls ``fn(rank, world_size, *args)`` on every rank; returns the results ordered by rank.
        ``timeout_s`` bounds this run (not the ranks' start)."""
        payload = pickle.dumps((fn, args))  # here, so that an unpicklable job fails at once
        if self._procs is None:
            self._start()
        job_id = next(self._job_ids)
        for jobs in self._jobs:
            jobs.put((job_id, payload))
        outputs = _output_paths(self._output_dir.name, f"job{job_id}", self.world_size, "out")
        errors = _output_paths(self._output_dir.name, f"job{job_id}", self.world_size, "err")
        try:
            collected = self._collect(job_id, timeout_s, f"did not finish within {timeout_s}s")
        except BaseException:
            # A failed run may have left a collective half done: stop the ranks (they are not
            # asked: one may be stuck waiting for a peer) and start new ones next time.
            self._stop(graceful=False)
            raise
        finally:
            _forward_outputs(outputs)
            _forward_outputs(errors, fd=2)
            for path in outputs + errors:
                if os.path.exists(path):
                    os.remove(path)
            if self._procs is None:
                self._clean_up()
        return [pickle.loads(collected[rank]) for rank in range(self.world_size)]

    def _start(self) -> None:
        refuse_if_ranks_forbidden(f"a session of {self.world_size} local ranks")
        ctx = mp.get_context("spawn")
        self._output_dir = tempfile.TemporaryDirectory(prefix="thunder_overlap_session_")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, self.world_size, port, self.backend, self.group_timeout_s, self.preload, self._jobs[rank], self._results,
                      self._output_dir.name),
                daemon=True,
            )  # fmt: skip
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self.starts += 1
        try:
            self._collect(_READY, self.start_timeout_s, f"did not start within {self.start_timeout_s}s")
        except BaseException:
            self._stop(graceful=False)
            self._clean_up()
            raise

    def _collect(self, job_id: int, timeout_s: float, late: str) -> dict[int, bytes]:
        """Each rank's pickled result of ``job_id``; raises as ``run_local_ranks`` does."""
        collected: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while len(collected) < self.world_size:
            try:
                found, rank, ok, value = self._results.get(timeout=1.0)
            except queue_module.Empty:
                # A rank exits only when told to: any exit here is a crash (killed by a signal,
                # or os._exit in the function).
                exited = [i for i, p in enumerate(self._procs) if p.exitcode is not None and i not in collected]
                if exited:
                    codes = ", ".join(_exit_status(self._procs[i].exitcode) for i in exited)
                    raise RuntimeError(f"ranks {exited} exited: {codes} (any stack faulthandler wrote is in standard error)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(self.world_size)) - set(collected))} {late}") from None
                continue
            if found != job_id:
                continue  # cannot happen after a restart; ignored rather than misattributed
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}{_dead_peers(self._procs, rank, grace_s=1.0)}")
            collected[rank] = value
        return collected

    def close(self) -> None:
        """Stops the ranks (each finishes its loop and leaves the process group)."""
        if self._procs is not None:
            self._stop(graceful=True)
            self._clean_up()

    def _stop(self, *, graceful: bool) -> None:
        procs, self._procs = self._procs, None
        if graceful:
            for jobs, p in zip(self._jobs, procs, strict=True):
                if p.is_alive():
                    jobs.put(None)
            deadline = time.monotonic() + 10
            for p in procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

    def _clean_up(self) -> None:
        for q in (*self._jobs, self._results):
            q.close()
            q.cancel_join_thread()
        _forward_outputs(_output_paths(self._output_dir.name, "idle", self.world_size, "out"))
        _forward_outputs(_output_paths(self._output_dir.name, "idle", self.world_size, "err"), fd=2)
        self._output_dir.cleanup()

    def __enter__(self) -> RankSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RankSessions:
    """One ``RankSession`` per world size, each started on first use; ``run`` has
    ``run_local_ranks``'s signature."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.sessions: dict[int, RankSession] = {}

    def run(self, fn: Callable[..., Any], world_size: int = 2, args: tuple = (), *, timeout_s: float = 600) -> list[Any]:
        session = self.sessions.setdefault(world_size, RankSession(world_size, **self.options))
        return session.run(fn, args, timeout_s=timeout_s)

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
