"""What the docs tell a user to type or believe matches the code and the measurements they cite (issue 34): every
documented command line uses options the command has, the README quotes the kernel figure docs/benchmarks.md stands
by, docs/int8.md says which calibrations the search tries on which CPU, and the Makefile's PyTorch index is optional."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every ``servopt …`` line in a fenced code block, comments cut, continuations joined."""
    found, block, pending = [], False, ""
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            block, pending = not block, ""
            continue
        if not block:
            continue
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if line.startswith("servopt "):
            found.append((n, line.split("  #")[0].split(" # ")[0]))
    return found


def test_every_documented_command_line_uses_options_the_command_has():
    """docs/serving.md showed `servopt serve model.xml --hint THROUGHPUT`; serve has no --hint (the hint is the
    runtime option `-o hint=THROUGHPUT`), so the line failed as typed."""
    import typer

    from servopt.cli import app

    root = typer.main.get_command(app)
    wrong = []
    for doc in DOCS:
        for n, line in _command_lines(doc.read_text(encoding="utf-8")):
            words, command = shlex.split(line), root
            i = 1
            while hasattr(command, "commands") and i < len(words) and words[i] in command.commands:
                command, i = command.commands[words[i]], i + 1
            if hasattr(command, "commands"):
                wrong.append(f"{doc.name}:{n}: no such command: {line}")
                continue
            options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
            wrong += [f"{doc.name}:{n}: {w}: {line}" for w in words[i:]
                      if w.startswith("-") and w != "-" and w.split("=")[0] not in options]
    assert not wrong, "\n".join(wrong)


def test_the_readme_quotes_the_kernel_figure_the_benchmarks_stand_by():
    """docs/benchmarks.md withdrew "about three quarters" (it counted the fp32 attention as INT8 product time) for
    the corrected products / kernel range; the README must quote that range, not the withdrawn figure."""
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    figure = re.search(r"The INT8 products already run at (\S+) of what MLAS reaches", benchmarks)
    assert figure, "docs/benchmarks.md no longer states the products / kernel range this test compares against"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "three quarters" not in readme
    assert f"run at {figure.group(1)} of" in readme


def _row(doc: str, name: str) -> str:
    return next(line for line in doc.splitlines() if line.startswith(f"| `{name}`"))


def test_int8_doc_says_which_calibrations_the_search_tries_on_which_cpu():
    """On x86 without VNNI the search adds 7-bit weights to every point (20), and its cap of 16 keeps MinMax and the
    percentiles only: Entropy is never tried there, which docs/int8.md once did not say."""
    from servopt.cpu import CpuFeatures
    from servopt.passes.calibration_search import CalibrationSearchParams, search_space

    def methods(flags: set[str]) -> list[str]:
        space = search_space(CalibrationSearchParams(try_reduce_range=CpuFeatures(frozenset(flags)).int8_saturates))
        return [p["calibrate_method"] for p in space]

    avx2, vnni = methods({"avx2", "fma"}), methods({"avx2", "avx512f", "avx512_vnni"})
    assert len(vnni) == 10 and "Entropy" in vnni
    assert len(avx2) == 16 and "Entropy" not in avx2
    row = _row((ROOT / "docs" / "int8.md").read_text(encoding="utf-8"), "ort-quantize-calibration-search")
    assert "10 points, Entropy included" in row and "Entropy is not tried there" in row and "x86 without VNNI" in row


def _dry_install(**env: str) -> str:
    import os

    out = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "TORCH_INDEX"} | env)
    assert out.returncode == 0, out.stderr
    return next(line for line in out.stdout.splitlines() if "--require-hashes" in line and not line.startswith("#"))


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_the_pytorch_cpu_index_reaches_pip_only_when_named():
    """torch==2.13.0+cpu is on no plain index: a fresh machine elsewhere names PyTorch's CPU index (TORCH_INDEX, set
    in one place), and here, where pip's find-links has the wheel, the install command is unchanged."""
    assert "--extra-index-url" not in _dry_install()
    assert f"--extra-index-url {TORCH_CPU_INDEX} " in _dry_install(TORCH_INDEX=TORCH_CPU_INDEX)
    rules = [line for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
    assert sum("TORCH_INDEX ?=" in line for line in rules) == 1 and sum("--extra-index-url" in line for line in rules) == 1
    for doc in ("README.md", "docs/lock.md"):
        assert f"TORCH_INDEX={TORCH_CPU_INDEX}" in (ROOT / doc).read_text(encoding="utf-8"), doc
