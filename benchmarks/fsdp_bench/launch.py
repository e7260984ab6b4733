"""Launching one benchmark run as two ranks across a :class:`~fsdp_bench.netns.SlowLink`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fsdp_bench.netns import SlowLink

__all__ = ["BENCHMARK_SCRIPT", "rank_env", "run_on_link"]

BENCHMARK_SCRIPT = Path(__file__).resolve().parent.parent / "benchmark_fsdp.py"
# Any port: it exists only inside rank 0's namespace.
_MASTER_PORT = 29500
# Lines of a failed rank's log quoted in the error.
_LOG_TAIL_LINES = 30
_POLL_S = 0.2


def rank_env(link: SlowLink, rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(link.WORLD_SIZE),
        LOCAL_RANK="0",  # each rank is alone in its namespace, like one node each
        MASTER_ADDR=link.address(0),
        MASTER_PORT=str(_MASTER_PORT),
        # gloo would otherwise pick an address from the host name, which the namespace lacks.
        GLOO_SOCKET_IFNAME=link.interface(rank),
        # One core per rank: one intra-op thread, as torchrun's default.
        OMP_NUM_THREADS="1",
    )
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminates the process groups of the ranks started here that are still running."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _raise_if_failed(procs: list[subprocess.Popen], logs: list[Path], label: str) -> None:
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.poll() not in (None, 0):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:])
            raise RuntimeError(f"{label}: rank {rank} exited with {p.returncode}; end of {log}:\n{tail}")


def run_on_link(link: SlowLink, benchmark_args: list[str], log_dir: Path, label: str, timeout_s: float) -> None:
    """Runs benchmark_fsdp.py with ``benchmark_args`` as ranks 0 and 1 of ``link``; logs go to
    ``log_dir/{label}.rank{r}.log``. Raises, naming the failed rank and quoting its log, if any
    rank fails or the run exceeds ``timeout_s``; the other rank is then stopped."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    logs = [log_dir / f"{label}.rank{r}.log" for r in range(link.WORLD_SIZE)]
    try:
        for rank, log in enumerate(logs):
            argv = link.command(rank, [sys.executable, str(BENCHMARK_SCRIPT), *benchmark_args])
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(argv, env=rank_env(link, rank), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                )
        deadline = time.monotonic() + timeout_s
        while True:
            _raise_if_failed(procs, logs, label)
            if all(p.poll() is not None for p in procs):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: did not finish within {timeout_s:.0f} s; logs in {log_dir}")
            time.sleep(_POLL_S)
    finally:
        _stop(procs)
