"""examples/train_fsdp.py, run as the README shows it: torchrun on 2 gloo ranks, against the same
script on one rank with the same global batch, and resumed from its checkpoint.

Three runs of the tiny Llama-style litgpt model (about 30 s each on an idle 2-core machine,
mostly Thunder compiling): the README's two commands (2 ranks for 2 steps saving a checkpoint,
then 2 ranks resuming from it to step 4), as written, in a scratch directory holding the
examples, and 1 rank for 4 steps. Every loss must match the one-rank run's.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]
# The README's commands, run as written (tests/test_readme.py checks that it shows these).
SAVE = "torchrun --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 2 --device cpu --save-dir ckpt"
RESUME = "torchrun --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 4 --device cpu --resume ckpt"
RUN_AS_WRITTEN = (SAVE, RESUME)
# The reference: one rank, the same global batch, all four steps in one run.
ONE_RANK = "torchrun --standalone --nproc_per_node 1 examples/train_fsdp.py --steps 4 --device cpu"
# Seconds one torchrun may take: compiling and a few steps, with room for a loaded machine.
RUN_TIMEOUT_S = 300
# Both runs compute the same float32 math on the same tokens from the same initial weights; they
# differ only in the order of sums: two ranks average two half-batch losses and reduce-scatter
# two half-batch gradients where one rank sums the whole batch at once. That reorders sums of
# about 10^3-10^4 terms, a relative difference of order 1e-6 (float32's epsilon is 1.2e-7; the
# runs above differed by 2e-7). Later steps see parameters moved by AdamW, whose update per
# element is at most lr and differs only through those rounded gradients (elements whose
# gradient is below the rounding carry it divided by eps = 1e-8, but such a gradient is far
# smaller than eps), so over 4 steps the losses stay well within 1e-4 relative of each other;
# a real error (a missing or doubled gradient share, another batch) moves them by 1e-2 or more.
LOSS_RTOL = 1e-4
STEP_LINE = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d+)  grad norm (\d+\.\d+)  [\d,]+ tokens/s", re.M)


def _train(command: str, cwd: Path) -> tuple[dict[int, tuple[float, float]], str]:
    """Runs ``command`` in ``cwd`` (where ``examples/`` is the repository's); torchrun is the
    module of this interpreter's torch. Returns rank 0's (loss, gradient norm) by step and its
    output."""
    words = shlex.split(command)
    assert words[0] == "torchrun"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *words[1:]], capture_output=True, text=True, cwd=cwd, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, f"`{command}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return {int(m[1]): (float(m[3]), float(m[4])) for m in STEP_LINE.finditer(done.stdout)}, done.stdout


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A directory whose ``examples/`` is the repository's, so the commands write ``ckpt`` there."""
    directory = tmp_path_factory.mktemp("example")
    (directory / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return directory


@pytest.fixture(scope="module")
def one_rank_losses(scratch) -> dict[int, tuple[float, float]]:
    losses, _ = _train(ONE_RANK, scratch)
    assert sorted(losses) == [1, 2, 3, 4]
    return losses


def _assert_match(losses: dict[int, tuple[float, float]], reference: dict[int, tuple[float, float]]) -> None:
    """Losses, and the gradient norms each step clips by (the whole model's: a rank's own shards'
    would be about 1/sqrt(2) of it), as one rank's."""
    for step, (loss, norm) in losses.items():
        expected_loss, expected_norm = reference[step]
        assert math.isclose(loss, expected_loss, rel_tol=LOSS_RTOL), f"step {step}: loss {loss} against one rank's {expected_loss}"
        assert math.isclose(norm, expected_norm, rel_tol=LOSS_RTOL), f"step {step}: grad norm {norm} against one rank's {expected_norm}"


def test_two_ranks_match_one_rank_then_resume_from_their_checkpoint(scratch, one_rank_losses):
    ckpt = Path("ckpt")
    losses, out = _train(SAVE, scratch)
    assert sorted(losses) == [1, 2], out
    _assert_match(losses, one_rank_losses)
    # The model learns the synthetic pattern: the loss falls.
    assert one_rank_losses[4][0] < one_rank_losses[1][0]
    assert f"saved {ckpt} after step 2" in out
    # The step is saved inside the checkpoint (its extra state), nothing beside it.
    assert not (scratch / ckpt / "trainer.json").exists()

    # Loading it is all that runs: one rank says so as well as two would, and loads two ranks' shards.
    at_the_end, out = _train(SAVE.replace("--save-dir", "--resume").replace("--nproc_per_node 2", "--nproc_per_node 1"), scratch)
    assert not at_the_end and "nothing to train: the checkpoint is after step 2 and --steps is 2" in out, out

    resumed, out = _train(RESUME, scratch)
    assert f"resumed from {ckpt} after step 2" in out
    # Steps 3 and 4 continue from the checkpoint's weights and AdamW moments: as one run of 4 steps.
    assert sorted(resumed) == [3, 4], out
    _assert_match(resumed, one_rank_losses)


def test_bad_settings_are_said_once_before_training(scratch):
    (scratch / "a_file").write_text("")
    done = subprocess.run([sys.executable, "examples/train_fsdp.py", "--save-dir", "a_file"], capture_output=True, text=True,
                          cwd=scratch, timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 2 and "error: --save-dir a_file is a file; a checkpoint is a directory" in done.stderr, done.stderr
    # The default global batch of 8 on 3 ranks (as torchrun starts them): said by rank 0 alone,
    # with what to pass, before the ranks meet.
    message = "error: --global-batch 8 does not split over 3 ranks: pass a multiple of 3, such as --global-batch 9 or 6"
    for rank, says in ((0, message), (1, "")):
        env = {**os.environ, "WORLD_SIZE": "3", "RANK": str(rank)}
        done = subprocess.run([sys.executable, "examples/train_fsdp.py", "--device", "cpu"], capture_output=True, text=True,
                              cwd=scratch, env=env, timeout=RUN_TIMEOUT_S)  # fmt: skip
        assert done.returncode == 2 and done.stderr.strip() == says, done.stderr[-3000:]
