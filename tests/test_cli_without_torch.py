"""The command line answers ``--help`` and every usage error without importing torch or Thunder;
the package imports neither for any importer, its lazy exports behave as plain attributes, and the
``"fsdp-overlap"`` plugin is registered whenever Thunder's plugins load.

Each command runs in a fresh interpreter under ``python -X importtime``, which lists every module
the process imported on stderr; none may be torch or Thunder (importing them takes seconds).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import thunder_overlap

ROOT = Path(__file__).resolve().parents[1]
# Seconds a command may take: without torch they answer in well under one.
COMMAND_TIMEOUT_S = 120
HEAVY = ("torch", "thunder")


def _run(*args: str, importtime: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=COMMAND_TIMEOUT_S
    )


def _imported(stderr: str) -> list[str]:
    """Module names from ``-X importtime``'s lines: ``import time: self | cumulative | name``."""
    names = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.append(line.rsplit("|", 1)[1].strip())
    return names


def _heavy(names: list[str]) -> list[str]:
    return [n for n in names if n.split(".")[0] in HEAVY]


@pytest.mark.parametrize(
    ("argv", "status", "says"),
    [
        (["--help"], 0, ["usage: python -m thunder_overlap", "demo", "report"]),
        (["--version"], 0, [f"thunder_overlap {thunder_overlap.__version__}"]),
        (["report", "--help"], 0, ["--world-size", "--network"]),
        (["demo", "--help"], 0, ["--sharding", "--bucketing"]),
        (["reprot"], 2, ["unknown command 'reprot'; accepted: demo, report"]),
        (["report", "--network", "carrier-pigeon"], 2, ["unknown network 'carrier-pigeon'", "accepted: auto (the default)", "nvlink"]),
        (["report", "--sharding", "zero4"], 2, ["--sharding must be zero2, zero3 or auto (got 'zero4')"]),
        (["report", "--sharding", "auto"], 2, ["--sharding auto needs --memory-budget (e.g. --memory-budget 60GiB)"]),
        (["report", "--memory-budget", "60 parsecs"], 2, ["--memory-budget '60 parsecs' is not a size; accepted: a positive number"]),
        (["report", "--memory-budget", "0GiB"], 2, ["--memory-budget '0GiB' is not a size"]),
        (["report", "--bucketing", "blocks"], 2, ["--bucketing must be none, layer, block or auto (got 'blocks')"]),
        (["report", "--steps", "-1"], 2, ["--steps -1 is impossible; accepted: 0"]),
        (["report", "--device-profile", "tpu"], 2, ["unknown device profile 'tpu'; accepted: a100, cpu, h100, h200"]),
        (["report", "--world-size", "0"], 2, ["--world-size 0 is impossible"]),
        (["report", "--seq-len", "0"], 2, ["--seq-len 0 is impossible"]),
        (["report", "--param-dtype", "bf17"], 2, ["--param-dtype 'bf17' is not a dtype", "accepted: bfloat16, float16, float32 or bf16"]),
        (["report", "--param-dtype", "bf16", "--dtype", "bf16"], 2, ["--param-dtype bfloat16 casts nothing for parameters of --dtype"]),
        (["report", "--param-dtype", "bf16", "--reduce-dtype", "fp16"], 2, ["--reduce-dtype float16 is not as wide as --param-dtype"]),
        (
            ["report", "--param-dtype", "bf16", "--reduce-dtype", "bf16", "--bucketing", "block"],
            2,
            ["--reduce-dtype bfloat16 with --bucketing block: they reduce in the parameters' dtype (--dtype float32)", "--bucketing none"],
        ),
        (
            ["report", "--param-dtype", "bf16", "--reduce-dtype", "bf16", "--world-size", "4", "--shard-group-size", "2"],
            2,
            ["--reduce-dtype bfloat16 with --shard-group-size: they reduce in the parameters' dtype", "accepted: --reduce-dtype float32"],
        ),
        (["demo", "--sharding", "zero4"], 2, ["invalid choice: 'zero4'", "'zero2', 'zero3'"]),
        (["demo", "--steps", "1"], 2, ["--steps 1 is not allowed; it must be at least 2"]),
    ],
)
def test_help_and_usage_errors_import_no_torch(argv, status, says):
    done = _run("-m", "thunder_overlap", *argv)
    assert done.returncode == status, done.stderr[-3000:]
    printed = done.stdout + "\n".join(line for line in done.stderr.splitlines() if not line.startswith("import time:"))
    for words in says:
        assert words in printed, printed
    names = _imported(done.stderr)
    assert "thunder_overlap" in names  # the check reads real import lines
    assert not _heavy(names), f"`python -m thunder_overlap {' '.join(argv)}` imported {_heavy(names)[:5]}"


@pytest.mark.slow
def test_the_public_names_load_on_first_use_with_thunder_quiet():
    # The package imports nothing heavy, whoever imports it; the first name used binds every name of
    # __all__ to the object the library defines, Thunder's known import warning dropped.
    probe = """
import sys, warnings
warnings.simplefilter("always")
import thunder_overlap
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "thunder")], "imported at package import"
assert set(thunder_overlap.__all__) <= set(dir(thunder_overlap))
import thunder_overlap.report._cli  # the subpackage "report" does not take the function's name
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "thunder")], "imported by report._cli"
report = thunder_overlap.report
from thunder_overlap.report._report import report as report_function
from thunder_overlap.api import fsdp
assert report is report_function and thunder_overlap.fsdp is fsdp
from thunder_overlap import OverlapConfig
assert OverlapConfig is thunder_overlap.OverlapConfig
try:
    thunder_overlap.fdsp
except AttributeError as e:
    assert "no attribute 'fdsp'" in str(e)
else:
    raise AssertionError("a misspelt name must raise AttributeError")
warnings.warn("a warning of the program's own")
print("ok")
"""
    done = _run("-c", probe, importtime=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "transformer_engine module not found" not in done.stderr
    # Only that warning is filtered, and only while Thunder imports: others still show.
    assert "a warning of the program's own" in done.stderr


PLUGIN_REGISTERED = """
from thunder.plugins import get_plugin
from thunder_overlap.plugin import FSDPOverlap
assert get_plugin("fsdp-overlap") is FSDPOverlap
assert not [f for f in sys.meta_path if type(f).__module__ == "thunder_overlap"], "the import hook stayed"
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "before",
    [
        "import thunder_overlap\nimport thunder",  # the README's order, no public name used
        "import thunder\nimport thunder_overlap",
        "import thunder.plugins\nimport thunder_overlap",  # registered at once
    ],
    ids=["package-first", "thunder-first", "plugins-first"],
)
def test_the_plugin_is_registered_when_thunders_plugins_load(before):
    done = _run("-c", f"import sys\n{before}\n{PLUGIN_REGISTERED}", importtime=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    # Thunder imported after the package, by the program itself, is as quiet as by the package;
    # imported before it, Thunder's warning is the program's own.
    quiet = before.startswith("import thunder_overlap")
    assert ("transformer_engine module not found" in done.stderr) != quiet, done.stderr[-3000:]


@pytest.mark.slow
def test_the_readmes_plugin_line_compiles_by_name_after_import(one_rank_gloo_group, monkeypatch):
    import thunder
    from thunder.recipes import BaseRecipe

    from thunder_overlap._transforms import OverlapScheduleTransform

    # As the README writes it: the default recipe needs nvFuser; on CPU the torch.compile fuser
    # stands in, its regions run by Dynamo's eager backend (Inductor's C++ compilation of them is
    # PyTorch's work, and most of this test's time: tests/test_trace_order_fake_group.py).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    readme = (ROOT / "README.md").read_text()
    (line,) = re.findall(r"`(thunder\.compile\(model, [^`]*\))`", readme)
    assert 'plugins="fsdp-overlap"' in line and "BaseRecipe" in line, line
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(2)))
    jm = eval(line, {"thunder": thunder, "BaseRecipe": BaseRecipe, "model": model})
    x = torch.randn(3, 4)
    out = jm(x)
    assert OverlapScheduleTransform.of(jm) is not None  # thunder_overlap's transforms ran
    # One rank: each shard is its whole parameter, so the output is the plain model's on them.
    w1, b1, w2, b2 = (p.detach() for _, p in jm.named_parameters())
    gelu, linear = nn.functional.gelu, nn.functional.linear
    torch.testing.assert_close(out, gelu(linear(gelu(linear(x, w1, b1)), w2, b2)))
