"""RankSession: ranks started once run function after function in the same processes; a rank's
exception, a crash and a hang are reported as run_local_ranks reports them, and the next run
starts fresh ranks. Its own session (torch alone preloaded: these functions need no Thunder)."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from thunder_overlap.testing.rank_session import GC_THRESHOLDS, RankSession

pytestmark = pytest.mark.ranks


def _rank_sum_and_pid(rank: int, world_size: int, offset: int) -> tuple[int, float, int]:
    value = torch.tensor([float(rank + offset)])
    dist.all_reduce(value)
    return rank, value.item(), os.getpid()


def _fails_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("no good on rank 1")
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def _rank_0_segfaults(rank: int, world_size: int) -> None:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def _sleeps(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _gc_thresholds(rank: int, world_size: int) -> tuple[int, ...]:
    return gc.get_threshold()


def _prints(rank: int, world_size: int) -> None:
    print(f"rank {rank} says hello")


def _started(session: RankSession) -> int:
    """Runs a function, so that the ranks are alive whatever the previous test left; returns
    how many times they were started."""
    session.run(_rank_sum_and_pid, (0,))
    return session.starts


@pytest.fixture(scope="module")
def session():
    with RankSession(2, preload=("torch",)) as session:
        yield session


def test_functions_run_on_every_rank_in_the_same_processes(session):
    first = session.run(_rank_sum_and_pid, (10,))
    second = session.run(_rank_sum_and_pid, (20,))
    assert [r[:2] for r in first] == [(0, 21.0), (1, 21.0)]
    assert [r[:2] for r in second] == [(0, 41.0), (1, 41.0)]
    assert [r[2] for r in first] == [r[2] for r in second] and session.starts == 1


def test_ranks_and_this_worker_collect_garbage_rarely(session):
    # Compile after compile, Python's default thresholds spend a sixth of the CPU collecting.
    assert session.run(_gc_thresholds) == [GC_THRESHOLDS] * 2
    assert gc.get_threshold() == GC_THRESHOLDS  # tests/conftest.py


def test_each_runs_output_follows_it_rank_after_rank(session, capfd):
    session.run(_prints)
    assert "rank 0 says hello\nrank 1 says hello\n" in capfd.readouterr().out


def test_an_unpicklable_function_fails_at_once_and_leaves_the_ranks_running(session):
    starts = _started(session)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        session.run(lambda rank, world_size: rank)
    assert session.alive and session.starts == starts
    assert [r[1] for r in session.run(_rank_sum_and_pid, (0,))] == [1.0, 1.0]


def test_a_ranks_exception_names_it_and_the_next_run_starts_fresh_ranks(session):
    starts = _started(session)
    with pytest.raises(RuntimeError, match=r"rank 1 failed:\n(.|\n)*ValueError: no good on rank 1"):
        session.run(_fails_on_rank_1)
    assert not session.alive
    assert [r[1] for r in session.run(_rank_sum_and_pid, (0,))] == [1.0, 1.0]
    assert session.starts == starts + 1


def test_a_rank_killed_by_a_signal_is_named_with_its_stack(session, capfd):
    with pytest.raises(RuntimeError) as raised:
        session.run(_rank_0_segfaults, timeout_s=60)
    message = str(raised.value)
    # Whichever the parent sees first (rank 0's exit, or rank 1's failed barrier), rank 0's
    # death is what it reports.
    assert "rank 0: killed by SIGSEGV" in message or "ranks [0] exited: killed by SIGSEGV" in message, message
    stderr = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in stderr and "_rank_0_segfaults" in stderr
    assert [r[1] for r in session.run(_rank_sum_and_pid, (0,))] == [1.0, 1.0]


def test_a_run_past_its_timeout_fails_and_the_next_run_starts_fresh_ranks(session):
    starts = _started(session)
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 2s"):
        session.run(_sleeps, (600,), timeout_s=2)
    assert [r[1] for r in session.run(_rank_sum_and_pid, (0,))] == [1.0, 1.0]
    assert session.starts == starts + 1
