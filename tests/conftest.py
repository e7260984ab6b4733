"""Process groups and rank processes shared by the test modules, and the two tiers.

Each process-group fixture creates the default process group and destroys it when its scope
ends, so no test depends on another having run first. A group a fixture finds already alive is an
error: the fixture that made it did not clean up, and the two modules would silently share one
world size.

``local_ranks`` runs functions on local gloo ranks started once per world size for the whole
run (thunder_overlap.testing.rank_session), instead of spawning ranks, each importing torch and
Thunder, for every call.

Tiers: a test that starts rank processes (``local_ranks``, ``run_local_ranks``, torchrun, the
demo) is marked ``ranks``, one that takes seconds (Thunder tracing models, compiling, a Python
importing torch) ``slow``; ``make test-fast`` runs the others (``-m "not ranks and not slow"``),
``make test`` all, so every test is in a tier. An unmarked test that requests ``local_ranks`` fails
collection, and one that starts ranks another way fails when it does, so no spawning test can slip
into the fast tier; unmarked tests that took over ``SLOW_S`` are named at the end of the run.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from collections.abc import Iterator

# One intra-op thread per process, set before torch loads (rank processes inherit it): make test
# runs two pytest workers and pairs of ranks on a few cores, and torch's default pool of one
# thread per core in every process oversubscribes them for models this small (13% less CPU and
# 11% less time on test_e2e_two_ranks.py and test_mixed_precision_fake_group.py on 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import hypothesis  # noqa: E402
import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore

from thunder_overlap.testing.local_ranks import NO_RANKS_ENV, refuse_if_ranks_forbidden  # noqa: E402
from thunder_overlap.testing.rank_session import RankSessions, collect_garbage_rarely  # noqa: E402

# Each worker compiles model after model: it collects garbage rarely, as the sessions' ranks do.
collect_garbage_rarely()


# Hypothesis's first test in a process registers its random generator, which runs a full
# collection and gc.get_referrers over the whole heap: one example here, while the heap is small,
# instead of in whichever property test follows modules that keep compiled models (10 s then).
@hypothesis.settings(max_examples=1, database=None)
@hypothesis.given(hypothesis.strategies.none())
def _register_hypothesis_random(_) -> None:
    pass


# Hypothesis warns about strategies evaluated while conftest loads, as slow work at start-up: here
# it is the point.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", hypothesis.errors.HypothesisSideeffectWarning)
    _register_hypothesis_random()

RANKS, SLOW = "ranks", "slow"
# Seconds (setup and call) past which an unmarked test is named at the end of the run: the fast
# tier's tests take well under one each on an idle machine, the slow ones 4 and more.
SLOW_S = 3.0


def _describe_default_group() -> str:
    return f"backend {dist.get_backend()!r}, {dist.get_world_size()} ranks"


def _default_group(backend: str, world_size: int, store: dist.Store) -> Iterator[dist.ProcessGroup]:
    if dist.is_initialized():
        alive = _describe_default_group()
        raise RuntimeError(f"a default process group is already alive ({alive}); the fixture or test that made it must destroy it")
    dist.init_process_group(backend, store=store, rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fake_group_2() -> Iterator[dist.ProcessGroup]:
    """PyTorch's fake backend as rank 0 of 2, the size of the gloo runs: a ring launch pays one
    latency there, where at 8 ranks it pays seven."""
    yield from _default_group("fake", 2, FakeStore())


@pytest.fixture(scope="module")
def fake_group_4() -> Iterator[dist.ProcessGroup]:
    """PyTorch's fake backend as rank 0 of 4: collectives complete at once, nothing is sent, so
    tests see trace order and in-flight accounting, not numerics."""
    yield from _default_group("fake", 4, FakeStore())


@pytest.fixture(scope="module")
def fake_group_8() -> Iterator[dist.ProcessGroup]:
    """As ``fake_group_4``, at 8 ranks."""
    yield from _default_group("fake", 8, FakeStore())


@pytest.fixture(scope="module")
def one_rank_gloo_group() -> Iterator[dist.ProcessGroup]:
    """A real gloo group of one rank in this process: collectives run (as copies), no spawn."""
    yield from _default_group("gloo", 1, dist.HashStore())


@pytest.fixture(autouse=True)
def _no_process_group_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that leaves a default process group it created behind (fixtures' groups are
    set up before and torn down after this check, so they do not count)."""
    alive_before = dist.is_initialized()
    yield
    if dist.is_initialized() and not alive_before:
        leaked = _describe_default_group()
        dist.destroy_process_group()  # so that the next test starts clean
        pytest.fail(f"{request.node.nodeid} left a default process group alive ({leaked})")


@pytest.fixture(scope="session")
def local_ranks():
    """``run_local_ranks(fn, world_size=2, args=(), *, timeout_s=600)`` on ranks shared by every
    test of the run (one RankSession per world size). The functions sent build their own models
    and set their own seeds; one that patches anything restores it."""
    sessions = RankSessions()
    yield sessions.run
    sessions.close()


# --- tiers ---------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before -m deselects: an unmarked test fails the fast tier too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if "local_ranks" in item.fixturenames and item.get_closest_marker(RANKS) is None]
    if unmarked:
        raise pytest.UsageError(
            f"these tests start rank processes (through the local_ranks fixture) but are not marked `{RANKS}`, "
            f"so make test-fast would run them: mark them (pytestmark = pytest.mark.{RANKS} for a whole module):\n  "
            + "\n  ".join(unmarked)
        )
    # With pytest-xdist's --dist loadgroup (make test): every test on the shared rank sessions runs
    # in one worker, which starts them once; any other test runs in the worker that runs the rest
    # of its module, which sets the module's fixtures (compiled models) up once.
    group_of = []
    for item in items:
        shares_ranks = "local_ranks" in item.fixturenames  # directly or through a fixture
        group_of.append("local_ranks" if shares_ranks else item.nodeid.split("::")[0])
        item.add_marker(pytest.mark.xdist_group(group_of[-1]))
    # The longest groups first. With --no-loadscope-reorder (make test) xdist hands the groups out
    # in this order, one at a time to whichever worker runs low; its default order, by number of
    # tests, left the modules of a few minutes-long scripts (examples, demo) to the end, where
    # one worker ran them alone after the other had finished (about 200 s of a 20-minute run).
    # The shared rank sessions' group (the longest by far), then the groups that start processes,
    # then the slow ones, then the rest, each in the order collected.
    order_of_group: dict[str, int] = {}
    for item, group in zip(items, group_of, strict=True):
        order = 0 if group == "local_ranks" else 1 if item.get_closest_marker(RANKS) else 2 if item.get_closest_marker(SLOW) else 3
        order_of_group[group] = min(order, order_of_group.get(group, order))
    ordered = sorted(zip(items, group_of, strict=True), key=lambda pair: order_of_group[pair[1]])
    items[:] = [item for item, _ in ordered]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """While a test not marked ``ranks`` runs (its fixtures of any scope included), starting ranks
    in this process or a child (the demo) raises, naming the test (local_ranks.NO_RANKS_ENV), and
    so does running torchrun."""
    unmarked = item.get_closest_marker(RANKS) is None
    if unmarked:
        os.environ[NO_RANKS_ENV] = item.nodeid
    try:
        yield
    finally:
        os.environ.pop(NO_RANKS_ENV, None)


_popen_init = subprocess.Popen.__init__


def _command_words(args) -> list[str]:
    return [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()


def _guarded_popen_init(self, args, *rest, **kwargs) -> None:
    words = _command_words(args)
    # torchrun's workers are not our ranks: the command itself is refused.
    if "torch.distributed.run" in words or any(w.endswith("torchrun") for w in words):
        refuse_if_ranks_forbidden(f"`{' '.join(words)}`")
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init


_unmarked_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when in ("setup", "call") and RANKS not in report.keywords and SLOW not in report.keywords:
        _unmarked_seconds[report.nodeid] = _unmarked_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    slow = sorted(((s, nodeid) for nodeid, s in _unmarked_seconds.items() if s > SLOW_S), reverse=True)
    if slow:
        terminalreporter.section(f"unmarked tests slower than {SLOW_S:g} s (mark them slow to keep make test-fast fast)")
        for seconds, nodeid in slow:
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")
