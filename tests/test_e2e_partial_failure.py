"""A checkpoint save or load that fails on one rank: every rank gets the same clear error at once,
nothing hangs, nothing is lost, and training goes on.

One spawn of two gloo ranks runs every scenario in turn (each spawn costs seconds of imports),
catching each error as a training loop that wants to carry on would (``except Exception``), then
training a step: a rank left inside ``save`` or ``load`` would hang that step, and the spawn's
timeout turns a hang into a failure here instead of a stuck run. Before the phases were agreed,
rank 0 failing alone to create ``<path>.saving`` hung both ranks, and torch's errors were
``BaseException``s that such a loop did not catch.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from thunder_overlap import checkpoint
from thunder_overlap.checkpoint import StateDictOptions

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
# Imports and a compile take about 10 s per spawn; a hang is what the rest of this budget catches.
TIMEOUT_S = 180


@dataclass(frozen=True)
class Outcome:
    """How one call ended on one rank: None for no error, else the error's classes and text."""

    error: str | None = None
    classes: tuple[str, ...] = ()
    is_exception: bool = True
    message: str = ""


def _attempt(call) -> Outcome:
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - recorded: the tests check it is an Exception
        return Outcome(type(error).__name__, tuple(c.__name__ for c in type(error).__mro__), isinstance(error, Exception), str(error))
    return Outcome()


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> float:
    torch.manual_seed(100 * step + rank)
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optim_state = checkpoint.get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.clone() for k, v in model_state.items()}, "optim": optim_state["state"]}


def _on_rank_0(rank: int, action) -> None:
    """``action`` on rank 0, then every rank waits for it (files the scenario needs)."""
    if rank == 0:
        action()
    dist.barrier()


def _damaged_copy(source: Path, target: Path, damage) -> None:
    shutil.copytree(source, target)
    damage(target)


def _flip_4_bytes(directory: Path) -> None:
    data = directory / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 4] = bytes(b ^ 0xFF for b in raw[middle : middle + 4])
    data.write_bytes(bytes(raw))


def _truncate(directory: Path) -> None:
    data = directory / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _session(rank: int, world_size: int, directory: str) -> dict:
    import thunder_overlap

    root = Path(directory)
    torch.manual_seed(0)
    model = thunder_overlap.fsdp(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)), device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = 0
    out: dict = {"losses": []}

    def train() -> None:
        nonlocal step
        out["losses"].append(_train_step(model, optimizer, step, rank))
        step += 1

    train()
    good = root / "good"
    checkpoint.save(good, model, optimizer)
    out["good"] = _full(model, optimizer)
    train()

    # Issue 40, case 1: rank 0 alone fails to make <path>.saving: its parent is a file (made before the spawn).
    out["parent_is_a_file"] = _attempt(lambda: checkpoint.save(root / "a_file" / "ckpt", model, optimizer))
    train()
    # ... a stale <path>.saving that is no directory.
    _on_rank_0(rank, lambda: (root / "good.saving").write_text("not a staging directory"))
    out["stale_staging"] = _attempt(lambda: checkpoint.save(good, model, optimizer))
    _on_rank_0(rank, lambda: (root / "good.saving").unlink())
    train()
    # ... the rename that publishes the new checkpoint fails on rank 0, after the old one moved aside.
    staging = good.with_name("good.saving")
    real_rename = Path.rename

    def failing_rename(self, target):
        if self == staging:
            raise OSError("injected: the rename failed")
        return real_rename(self, target)

    with mock.patch.object(Path, "rename", failing_rename) if rank == 0 else contextlib.nullcontext():
        out["publish_fails"] = _attempt(lambda: checkpoint.save(good, model, optimizer))
    out["left_beside_good"] = sorted(p.name for p in root.iterdir() if p.name.startswith("good"))
    train()

    # Issue 40, case 5: loads that fail on rank 1 alone (another path), a file damaged, truncated, missing.
    out["missing_on_rank_1"] = _attempt(lambda: checkpoint.load(good if rank == 0 else root / "nowhere", model, optimizer))
    train()
    _on_rank_0(rank, lambda: _damaged_copy(good, root / "flipped", _flip_4_bytes))
    out["before_flipped"] = _full(model, optimizer)
    out["flipped"] = _attempt(lambda: checkpoint.load(root / "flipped", model, optimizer))
    out["unchanged_after_flipped"] = _full(model, optimizer)
    train()
    _on_rank_0(rank, lambda: _damaged_copy(good, root / "truncated", _truncate))
    out["truncated_unverified"] = _attempt(lambda: checkpoint.load(root / "truncated", model, optimizer, verify=False))
    _on_rank_0(rank, lambda: _damaged_copy(good, root / "missing_file", lambda d: (d / "__0_0.distcp").unlink()))
    out["missing_file"] = _attempt(lambda: checkpoint.load(root / "missing_file", model, optimizer))

    # After all that, the first checkpoint loads as saved, and both ranks train and save on.
    out["good_loads"] = _attempt(lambda: checkpoint.load(good, model, optimizer))
    out["loaded"] = _full(model, optimizer)
    train()
    out["saves_again"] = _attempt(lambda: checkpoint.save(good, model, optimizer))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, local_ranks):
    directory = tmp_path_factory.mktemp("partial_failure")
    (directory / "a_file").write_text("a file where a checkpoint's parent directory should be")
    return local_ranks(_session, WORLD_SIZE, (str(directory),), timeout_s=TIMEOUT_S)


def _assert_states_equal(actual, expected) -> None:
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            _assert_states_equal(actual[key], expected[key])
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _same_error_on_every_rank(results: list[dict], scenario: str, error: str) -> str:
    outcomes = [r[scenario] for r in results]
    assert all(o.error == error and o.is_exception and "CheckpointError" in o.classes for o in outcomes), outcomes
    assert len({o.message for o in outcomes}) == 1, "the ranks raised different errors"
    return outcomes[0].message


def test_every_rank_trains_on_after_every_failure(ranks):
    # Every step ran, on both ranks: a rank left inside save or load would hang its peer's step.
    assert [len(r["losses"]) for r in ranks] == [8, 8]
    assert all(r["good_loads"] == Outcome() and r["saves_again"] == Outcome() for r in ranks)


def test_rank_0_failing_to_make_the_staging_directory_is_every_ranks_error(ranks):
    message = _same_error_on_every_rank(ranks, "parent_is_a_file", "CheckpointError")
    assert "checkpoint.save(" in message and "failed on rank 0 of 2 while preparing the staging directory" in message
    assert "a_file/ckpt.saving" in message and "every rank raised this error" in message
    message = _same_error_on_every_rank(ranks, "stale_staging", "CheckpointError")
    assert "failed on rank 0 of 2" in message and "good.saving exists and is not a directory; remove it" in message
    assert message.endswith("good is as it was")


def test_a_publish_failing_on_rank_0_keeps_the_previous_checkpoint(ranks):
    message = _same_error_on_every_rank(ranks, "publish_fails", "CheckpointError")
    assert "failed on rank 0 of 2 while publishing" in message and "OSError: injected: the rename failed" in message
    # The old checkpoint went back in place, the staging directory was removed, and it loads as saved.
    assert ranks[0]["left_beside_good"] == ["good"]
    for r in ranks:
        _assert_states_equal(r["loaded"], r["good"])


def test_a_load_failing_on_rank_1_alone_is_every_ranks_error(ranks):
    outcomes = [r["missing_on_rank_1"] for r in ranks]
    assert all(o.error == "CheckpointNotFoundError" and "FileNotFoundError" in o.classes for o in outcomes), outcomes
    for o in outcomes:
        assert "failed on rank 1 of 2 while looking for the checkpoint: FileNotFoundError: no checkpoint at " in o.message
        assert "nowhere: it does not exist" in o.message and o.message.endswith("the model and optimizer are as they were")


def test_flipped_bytes_are_found_by_the_rank_that_checks_the_file_and_refused_on_every_rank(ranks):
    # Rank 1 verifies __0_0.distcp (the second of three files by name); rank 0 must refuse too.
    message = _same_error_on_every_rank(ranks, "flipped", "CorruptCheckpointError")
    assert "failed on rank 1 of 2 while verifying the files against the manifest (CRC32)" in message
    assert "flipped is damaged: __0_0.distcp has CRC32 0x" in message and ", the manifest records 0x" in message
    for r in ranks:
        _assert_states_equal(r["unchanged_after_flipped"], r["before_flipped"])


def test_a_truncated_file_read_unverified_is_an_exception_naming_it(ranks):
    outcomes = [r["truncated_unverified"] for r in ranks]
    assert all(o.error == "DistributedCheckpointError" and o.is_exception and "CheckpointException" in o.classes for o in outcomes)
    for o in outcomes:
        assert "torch.distributed.checkpoint failed reading" in o.message and "__1_0.distcp is " in o.message
        assert "(truncated)" in o.message and "may be partly loaded: load again before training on" in o.message


def test_a_missing_file_is_named(ranks):
    message = _same_error_on_every_rank(ranks, "missing_file", "CorruptCheckpointError")
    assert "failed on rank 1 of 2" in message and "__0_0.distcp is missing (the manifest records " in message
