"""Process groups shared by the test modules.

Each fixture creates the default process group and destroys it when its scope ends, so no test
depends on another having run first. A group a fixture finds already alive is an error: the
fixture that made it did not clean up, and the two modules would silently share one world size.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


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
