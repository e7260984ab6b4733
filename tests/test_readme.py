"""README.md's excerpts match fresh runs of their commands, and the commands print no
third-party chatter; every command the README shows runs as written (or, where it needs a GPU, a
network or minutes, its arguments parse); the README stays short and its links resolve.

The demo excerpt runs the whole demo once (about a minute on an idle 2-core machine: 2 gloo
ranks compile and train, then 4 meta-device traces predict 8 and 64 GPUs); every line must match
except the numbers on ``measured:`` lines.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from thunder_overlap._console import filter_known_output, without_known_output
from thunder_overlap.testing import readme_excerpts
from thunder_overlap.testing.demo import MEASURED_PREFIX
from thunder_overlap.testing.readme_excerpts import EXCERPTS, Excerpt, check, masked, read_block, replace_block

EXCERPT_BY_NAME = {e.name: e for e in EXCERPTS}
ROOT = readme_excerpts.ROOT
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md", ROOT / "CHANGELOG.md"]
README_MAX_BYTES = 15_000
# Seconds a command checked here may take (an example's --help imports torch and Thunder).
COMMAND_TIMEOUT_S = 300
GLOO_LINE = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def _readme() -> str:
    return readme_excerpts.README.read_text()


# The demo's excerpt runs the demo, which starts 2 gloo ranks.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.ranks] if EXCERPT_BY_NAME[n].argv[0] == "demo" else []) for n in sorted(EXCERPT_BY_NAME)]
)
def test_readme_excerpt_matches_a_fresh_run(name):
    excerpt = EXCERPT_BY_NAME[name]
    fresh = readme_excerpts.render(excerpt)  # raises on a failure or third-party chatter
    diff = check(excerpt.document.read_text(), excerpt, fresh)
    stale = f"{excerpt.document.relative_to(ROOT)} is stale; run python -m thunder_overlap.testing.readme_excerpts\n"
    assert not diff, stale + "\n".join(diff)


def test_masking_lets_only_measured_numbers_differ():
    excerpt = Excerpt("x", ("demo",), MEASURED_PREFIX)
    readme = f"intro\n<!-- x:start -->\n```text\npeak 1.30 MiB\n{MEASURED_PREFIX} thunder 12.5 ms\n```\n<!-- x:end -->\n"
    assert check(readme, excerpt, f"peak 1.30 MiB\n{MEASURED_PREFIX} thunder 9871.0 ms\n") == []
    assert check(readme, excerpt, f"peak 1.31 MiB\n{MEASURED_PREFIX} thunder 12.5 ms\n") != []
    # Words on a measured line still count.
    assert check(readme, excerpt, f"peak 1.30 MiB\n{MEASURED_PREFIX} thunder_overlap 12.5 ms\n") != []
    assert masked("a 1.5\n", None) == "a 1.5\n"


def test_a_failed_commands_error_shows_a_crashed_ranks_stacks_and_the_end():
    # A rank that dies in native code writes glibc's message and faulthandler's stacks at once;
    # its peer's "Connection reset by peer" and the command's error come thousands of lines later.
    crash = "malloc(): unaligned tcache chunk detected\nFatal Python error: Aborted\n\nThread 0x7f (most recent call first):\n"
    stderr = "compiling\n" * 2000 + crash + "  File x.py, line 1\n" * 3000 + "RuntimeError: rank 0 failed"
    shown = readme_excerpts.failure_output(stderr)
    assert crash in shown and shown.endswith("RuntimeError: rank 0 failed") and len(shown) < 9000
    assert readme_excerpts.failure_output("short error") == "short error"


def test_replace_block_round_trips_and_rejects_bad_markers():
    readme = "before\n<!-- x:start -->\n```text\nold\n```\n<!-- x:end -->\nafter\n"
    updated = replace_block(readme, "x", "new line\n")
    assert read_block(updated, "x") == "new line\n"
    assert updated.startswith("before\n") and updated.endswith("after\n")
    with pytest.raises(ValueError, match="exactly one"):
        read_block("no markers here", "x")
    with pytest.raises(ValueError, match="one fenced code block"):
        read_block("<!-- x:start -->\nloose text\n<!-- x:end -->", "x")


def test_known_output_is_dropped_even_interleaved_and_everything_else_kept(capfd):
    # A child process writes straight to the inherited descriptor, as gloo's native code does,
    # one message split around another as two ranks' pieces arrive.
    child = (
        "import os; g = os.environ['GLOO_LINE'].encode(); "
        "os.write(1, b'before\\n' + g[:13] + g + b'\\n' + g[13:] + b'\\nerror: a real problem\\n')"
    )
    with filter_known_output():
        subprocess.run([sys.executable, "-c", child], check=True, env={**os.environ, "GLOO_LINE": GLOO_LINE})
        os.write(1, b"parent line\n")
    out = capfd.readouterr().out
    assert out.splitlines() == ["before", "error: a real problem", "parent line"]


def test_filtering_a_closed_descriptor_does_nothing():
    # The library filters what its own process-group copy prints; a process started with its
    # stdout closed must still get its group.
    closed = os.open(os.devnull, os.O_WRONLY)
    os.close(closed)
    ran = False
    with filter_known_output(closed):
        ran = True
    assert ran


def test_unknown_text_next_to_known_output_is_kept():
    assert without_known_output(f"x{GLOO_LINE}\ny\n") == "xy\n"
    assert without_known_output("[Gloo] Rank 0 is connected to 0 peers\n") == "[Gloo] Rank 0 is connected to 0 peers\n"


# --- The README as a whole -------------------------------------------------------------------


def _fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def _readme_commands() -> list[str]:
    """Every command of the README's ``bash`` blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in _fenced_blocks(_readme(), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def test_readme_is_at_most_15000_bytes():
    size = len(_readme().encode())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/ (at most {README_MAX_BYTES})"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=COMMAND_TIMEOUT_S)


# What the Makefile's install steps run (uv, put into .venv by pip).
INSTALL = "uv pip install --quiet --compile-bytecode --python .venv/bin/python"
INSTALL_TEST = f"{INSTALL} -e '.[test]'"


def _check_make(words: list[str]) -> None:
    # A dry run (make -n) parses the Makefile and lists the recipe without creating .venv; -B lists
    # the install steps too where .venv is already installed (as in CI, which ran make test).
    done = _run(["make", "-n", "-B", *words[1:]])
    assert done.returncode == 0, done.stderr
    recipe = done.stdout
    if words[1:] == ["demo"]:
        # The demo needs the package alone, not the test extra.
        assert INSTALL + " -e .\n" in recipe and "[test]" not in recipe, recipe
        assert ".venv/bin/python -m thunder_overlap demo" in recipe, recipe
    elif words[1:] == ["test"]:
        assert INSTALL_TEST in recipe and "ruff check" in recipe and "-m pytest" in recipe, recipe
    elif words[1:] == ["test-fast"]:
        # The same install and lint; pytest without the tests that start rank processes or take seconds.
        assert INSTALL_TEST in recipe and "ruff check" in recipe, recipe
        assert "-m pytest" in recipe and '-m "not ranks and not slow"' in recipe, recipe
    else:
        pytest.fail(f"no check for the README's `{shlex.join(words)}`")


def _optional_dependencies() -> dict[str, list[str]]:
    """pyproject.toml's extras (read with a regex: tomllib is Python 3.11+, the project 3.10+)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {name: re.findall(r'"([^"]+)"', value) for name, value in re.findall(r"^(\w+)\s*=\s*\[(.*?)\]$", section, re.M)}


def _check_pip(words: list[str]) -> None:
    # Installing needs a network and gigabytes: the target is checked against pyproject.toml.
    parser = argparse.ArgumentParser(prog="pip install")
    parser.add_argument("-e", "--editable", default=None)
    parser.add_argument("requirements", nargs="*")
    assert words[:2] == ["pip", "install"], words
    args = parser.parse_args(words[2:])
    extras = _optional_dependencies()
    if args.editable is not None:
        match = re.fullmatch(r"\.(\[(\w+)\])?", args.editable)
        assert match, f"pip install -e {args.editable}: the README installs this checkout"
        assert match[2] is None or match[2] in extras, f"no extra {match[2]!r} in pyproject.toml"
    pinned = {r.replace(" ", "") for requirements in extras.values() for r in requirements}
    for requirement in args.requirements:
        assert requirement in pinned, f"pip install {requirement}: pyproject.toml pins none such ({sorted(pinned)})"


def _check_torchrun(words: list[str]) -> None:
    from test_e2e_example import RUN_AS_WRITTEN  # tests/ is on sys.path under pytest
    from torch.distributed.run import get_args_parser

    launch = get_args_parser().parse_args(words[1:])
    script = ROOT / launch.training_script
    assert script.is_file(), f"{launch.training_script} does not exist"
    if "cpu" in words:  # a CPU run: tests/test_e2e_example.py runs it as written
        assert shlex.join(words) in RUN_AS_WRITTEN, f"`{shlex.join(words)}` is not among the commands test_e2e_example runs"
        return  # which parses its arguments too: a --help of them here would start a Python for nothing
    # --help last: every argument before it is parsed (values, choices) before help exits.
    done = _run([sys.executable, str(script), *launch.training_script_args, "--help"])
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-3000:]


def _check_python_script(words: list[str]) -> None:
    from test_e2e_fabric_example import RUN_AS_WRITTEN  # tests/ is on sys.path under pytest

    # test_e2e_fabric_example runs it as written (its arguments parsed there): no --help run here.
    assert shlex.join(words) in RUN_AS_WRITTEN, f"`{shlex.join(words)}` is not among the commands test_e2e_fabric_example runs"
    assert (ROOT / words[1]).is_file(), f"{words[1]} does not exist"


def _check_thunder_overlap(words: list[str]) -> None:
    args = words[3:]
    if not args or {"--help", "-h", "--version"} & set(args):
        done = _run([sys.executable, *words[1:]])  # cheap: run as written
        assert done.returncode == 0, done.stderr[-3000:]
        return
    if args[0] == "report":  # tracing takes minutes: its arguments are parsed and checked
        from thunder_overlap.report._cli import _parse

        _parse(args[1:])
    elif args[0] == "demo":  # the demo excerpt runs it
        from thunder_overlap.testing.demo import _parse

        _parse(args[1:])
    else:
        pytest.fail(f"no check for the README's `{shlex.join(words)}`")


def _runs_help(command: str) -> bool:
    """Whether the command's check runs the example's --help (which imports torch and Thunder):
    a torchrun the e2e tests do not run as written (no CPU run)."""
    return command.startswith("torchrun") and "cpu" not in shlex.split(command)


@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=[pytest.mark.slow] if _runs_help(c) else [], id=c) for c in _readme_commands()]
)
def test_every_readme_command_runs_as_written(command):
    words = shlex.split(command)
    if words[0] == "make":
        _check_make(words)
    elif words[0] == "pip":
        _check_pip(words)
    elif words[0] == "torchrun":
        _check_torchrun(words)
    elif words[:3] == ["python", "-m", "thunder_overlap"]:
        _check_thunder_overlap(words)
    elif words[0] == "python" and words[1].startswith("examples/"):
        _check_python_script(words)
    else:
        pytest.fail(f"the README shows `{command}`, which no check here covers: add one")


def test_readme_shows_the_commands_a_user_needs():
    commands = _readme_commands()
    assert "make demo" in commands and "make test" in commands and "make test-fast" in commands
    assert "torchrun --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 2 --device cpu --save-dir ckpt" in commands


def test_readme_python_blocks_compile():
    for block in _fenced_blocks(_readme(), "python"):
        compile(block, "README.md", "exec")


def test_how_it_works_lists_every_part_of_the_package():
    section = _readme().split("## How it works", 1)[1]
    listed = set(re.findall(r"^\| `([^`]+)` \|", section, re.M))
    package = ROOT / "thunder_overlap"
    parts = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir() if p.name not in ("py.typed", "__pycache__")}
    assert parts <= listed, f"README's 'How it works' table misses {sorted(parts - listed)}"


@pytest.mark.parametrize("document", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (document.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{document.relative_to(ROOT)} links to {target}, which does not exist"
