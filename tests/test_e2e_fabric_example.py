"""examples/fabric_pretrain.py, run as a user runs it: Fabric's own launcher (``python`` starts
the second process) and torchrun, on 2 CPU devices against 1, and resumed across device counts.

Four runs of the tiny Llama (about 30 s each on an idle 2-core machine, mostly Thunder
compiling), the same global batch of 8 sequences a step, clipped by the global norm each step:

- 2 devices (2 micro-batches each, accumulated under ``no_backward_sync``), 4 steps, saving at
  step 2; 1 device (4 micro-batches), the same. Every loss and gradient norm must match.
- Resumed from the 1-device checkpoint on 2 devices under torchrun, and from the 2-device one on
  1 device: steps 3 and 4 must match the uninterrupted runs'.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]
# The README's command (tests/test_readme.py checks that it shows this one), saving in the
# default --out-dir, out/fabric_pretrain.
TWO = "python examples/fabric_pretrain.py --accelerator cpu --devices 2 --max-steps 4 --save-every 2"
RUN_AS_WRITTEN = (TWO,)
SCRIPT = "examples/fabric_pretrain.py --accelerator cpu --max-steps 4"
ONE = f"python {SCRIPT} --devices 1 --save-every 2 --out-dir out1"
RESUME_ON_TWO = f"torchrun --standalone --nproc_per_node 2 {SCRIPT} --devices 2 --resume out1/step-000002"
RESUME_ON_ONE = f"python {SCRIPT} --devices 1 --resume out/fabric_pretrain/step-000002"
RUN_TIMEOUT_S = 300
# The runs compute the same float32 math on the same tokens from the same initial weights and
# differ only in the order of sums (which rank's micro-batch, a reduce-scatter against a local
# sum): the argument of tests/test_e2e_example.py's LOSS_RTOL holds unchanged.
LOSS_RTOL = 1e-4
STEP_LINE = re.compile(r"^step (\d+)/4  loss (\d+\.\d+)  grad norm (\d+\.\d+)  lr ", re.M)


def _run(command: str, cwd: Path) -> tuple[dict[int, tuple[float, float]], str]:
    """Runs ``command`` (``python`` or ``torchrun``, this interpreter's) in ``cwd``; returns the
    printed (loss, gradient norm) by step, and the output."""
    words = shlex.split(command)
    prefix = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}[words[0]]
    done = subprocess.run([*prefix, *words[1:]], capture_output=True, text=True, cwd=cwd, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"`{command}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return {int(m[1]): (float(m[2]), float(m[3])) for m in STEP_LINE.finditer(done.stdout)}, done.stdout


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fabric_example")
    (directory / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return directory


@pytest.fixture(scope="module")
def uninterrupted(scratch) -> dict[str, tuple[dict, str]]:
    return {"two": _run(TWO, scratch), "one": _run(ONE, scratch)}


def _assert_match(steps: dict[int, tuple[float, float]], reference: dict[int, tuple[float, float]]) -> None:
    for step, (loss, norm) in steps.items():
        expected_loss, expected_norm = reference[step]
        assert math.isclose(loss, expected_loss, rel_tol=LOSS_RTOL), f"step {step}: loss {loss} against {expected_loss}"
        assert math.isclose(norm, expected_norm, rel_tol=LOSS_RTOL), f"step {step}: grad norm {norm} against {expected_norm}"


def test_two_devices_print_one_devices_losses(uninterrupted):
    (two, out), (one, _) = uninterrupted["two"], uninterrupted["one"]
    assert sorted(two) == sorted(one) == [1, 2, 3, 4], out
    _assert_match(two, one)
    assert one[4][0] < one[1][0]  # it learns the synthetic pattern
    assert "saved out/fabric_pretrain/step-000002" in out and "saved out/fabric_pretrain/step-000004" in out


@pytest.mark.parametrize(("command", "reference"), [(RESUME_ON_TWO, "one"), (RESUME_ON_ONE, "two")], ids=["1-to-2-torchrun", "2-to-1"])
def test_a_resumed_run_continues_as_the_uninterrupted_one_at_another_device_count(scratch, uninterrupted, command, reference):
    resumed, out = _run(command, scratch)
    assert re.search(r"resumed from out.*/step-000002 after step 2", out), out
    assert sorted(resumed) == [3, 4], out
    _assert_match(resumed, uninterrupted[reference][0])
