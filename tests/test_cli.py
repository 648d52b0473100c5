"""The ``autopar`` command line: its entry point called in this process (starting Python and importing
torch for each command took most of these tests' time), and once as a subprocess, as a user runs it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

REPO = Path(__file__).resolve().parents[1]


def autopar(*args: str) -> subprocess.CompletedProcess:
    """``autopar ARGS`` run by the console script's entry point in this process, from the
    repository's root: its exit status (argparse's exits included) and what it printed."""
    from autopar.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def autopar_process(*args: str) -> subprocess.CompletedProcess:
    """``autopar ARGS`` as a user runs it: a new Python process, from the repository's root."""
    command = [sys.executable, "-m", "autopar.tools.cli", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.smoke
def test_plan_prints_the_plan_and_saves_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    model = ["examples/gpt.py:build", "--mesh", "dp=2,tp=2", "batch_size=4"]
    proc = autopar_process("plan", *model, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "autopar plan on mesh dp=2×tp=2 (cpu-gloo)" in proc.stdout
    assert "memory per rank: parameters" in proc.stdout and "operators" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["mesh"] == {"dp": 2, "tp": 2} and saved["inputs"]["idx"]
    # explain: the chosen strategy among the alternatives, and why
    explained = autopar("explain", str(out), "linear_3")
    assert explained.returncode == 0, explained.stderr
    lines = explained.stdout.splitlines()
    assert lines[0] == "linear_3: aten.linear.default in module 'blocks.0.attn.proj' (anchor)"
    assert sum(line.startswith("  -> operands") for line in lines) == 1 and lines[-1].startswith("  why: ")
    by_module = autopar("explain", str(out), "blocks.0.mlp")  # a module path: its heavy ops
    assert by_module.returncode == 0, by_module.stderr
    assert "in module 'blocks.0.mlp.fc' (anchor)" in by_module.stdout
    assert "in module 'blocks.0.mlp.proj' (anchor)" in by_module.stdout
    missing = autopar("explain", str(out), "nothere")
    assert missing.returncode == 2 and "has no node or module 'nothere'" in missing.stderr
    # viz: the planned graph as Graphviz DOT, modules as clusters, redistributions in red
    dot = tmp_path / "graph.dot"
    drawn = autopar("viz", str(out), "-o", str(dot))
    assert drawn.returncode == 0, drawn.stderr
    text = dot.read_text()
    assert text.startswith("digraph plan {") and text.rstrip().endswith("}")
    assert 'subgraph "cluster_blocks.0.attn" { label="blocks.0.attn"' in text
    assert text.count("color=red") == len(saved["redistributions"]) - sum(
        r["dst"] in ("output", "<gradient sum>") for r in saved["redistributions"]
    )
    # show on a saved plan: the per-rank program, the model rebuilt from the words that named it
    shown = autopar("show", str(out))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("# per-rank program on mesh dp=2×tp=2 (rank 0)")
    assert saved["source"] == ["examples/gpt.py:build", "batch_size=4"]  # --batch/--seq: hf: models only


def test_show_prints_the_per_rank_program_of_a_transformers_model() -> None:
    proc = autopar(
        "show",
        "hf:gpt2",
        "n_layer=1",
        "n_embd=32",
        "n_head=4",
        "vocab_size=64",
        "--seq",
        "16",
        "--batch",
        "4",
        "--mesh",
        "dp=2",
        "--cluster",
        "fast-links",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# per-rank program on mesh dp=2 (rank 0)")
    assert "input_ids: S(0)" in proc.stdout and "autopar.all_reduce(" in proc.stdout


def test_plan_accumulates_microbatches_and_show_lowers_the_saved_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    model = ["examples/gpt.py:build", "batch_size=8", "--mesh", "dp=2", "--cluster", "fast-links"]
    proc = autopar("plan", *model, "--accumulation", "2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "gradient accumulation: 2 microbatches per step" in proc.stdout
    assert json.loads(out.read_text())["accumulation"] == 2
    shown = autopar("show", str(out))  # captured as planned: one microbatch of the two
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("# per-rank program on mesh dp=2 (rank 0)")
    searched = autopar("plan", "examples/gpt.py:build", "--devices", "2", "--accumulation", "2")
    assert searched.returncode != 0 and "accumulation=2 with a device count" in searched.stderr


def test_scaling_reports_amdahl_and_gustafson_and_plots(tmp_path: Path) -> None:
    plot = tmp_path / "scaling.png"
    proc = autopar(
        "scaling",
        "examples/gpt.py:build",
        "batch_size=8",
        "--devices",
        "2,4",
        "--cluster",
        "fast-links",
        "--plot",
        str(plot),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Amdahl (fixed batch): serial fraction" in proc.stdout and "Gustafson" in proc.stdout
    assert "fits every point within" in proc.stdout or "a poor fit, off by up to" in proc.stdout
    assert "│ 1       │" in proc.stdout and "│ 4       │" in proc.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "nofile.py:build", "--mesh", "dp=2"], "model 'nofile.py:build': no file nofile.py"),
        (["plan", "examples/gpt.py", "--mesh", "dp=2"], "expected path/to/file.py:factory or hf:ARCH"),
        (["plan", "examples/gpt.py:build", "--mesh", "dp=two"], "mesh 'dp=two': expected axis=size"),
        (
            ["plan", "examples/gpt.py:build", "--mesh", "dp=2", "--cluster", "tpu"],
            "got 'tpu'; presets are",
        ),
        (
            ["plan", "examples/gpt.py:build", "--mesh", "dp=2", "--budget", "lots"],
            "budget 'lots': expected bytes",
        ),
        (["plan", "hf:nosuchmodel", "--mesh", "dp=2"], "model hf:nosuchmodel: not a transformers model type"),
        (
            ["plan", "examples/gpt.py:build", "--mesh", "dp=2", "--budget", "1KB"],
            "no plan fits memory_budget",
        ),
    ],
)
def test_bad_input_is_one_line_and_status_2(args: list[str], message: str) -> None:
    proc = autopar(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"autopar {args[0]}: error: ") and message in lines[0], (
        lines
    )


def test_the_package_installs_the_console_script() -> None:
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="autopar")
    assert script.value == "autopar.tools.cli:main"


CHROMIUM = shutil.which("chromium")


def _screenshot(page: Path, out: Path, fragment: str = "") -> Any:
    from PIL import Image

    from autopar.tools.plan_view import HEADLESS

    window = ["--window-size=1200,2400", f"--screenshot={out}"]
    profile = f"--user-data-dir={out.parent / 'chromium'}"
    url = page.resolve().as_uri() + fragment
    subprocess.run([CHROMIUM, *HEADLESS, profile, *window, url], capture_output=True, timeout=120, check=True)
    return Image.open(out).convert("RGB")


@pytest.mark.smoke
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_viz_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    page = tmp_path / "graph.html"
    model = ["examples/gpt.py:build", "batch_size=4", "--mesh", "dp=2,tp=2", "--cluster", "fast-links"]
    proc = autopar("viz", *model, "-o", str(page))
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert "predicted step" in text and "axis dp: splits" in text and "layouts: one placement" in text
    # self-contained: nothing to fetch (the one URI is SVG's namespace name)
    assert (
        "src=" not in text and "href=" not in text and text.count("http") == text.count("http://www.w3.org/")
    )

    def inked(image: Any) -> tuple[int, int]:
        """Pixels not white, and pixels of the red that marks inserted collectives."""
        data = image.tobytes()
        pixels = list(zip(data[0::3], data[1::3], data[2::3]))
        red = sum(r > 180 and g < 80 and b < 80 for r, g, b in pixels)
        return sum(p != (255, 255, 255) for p in pixels), red

    closed = inked(_screenshot(page, tmp_path / "closed.png"))
    opened = inked(_screenshot(page, tmp_path / "opened.png", "#open=blocks,blocks.0"))
    assert closed[1] > 50, "collectives are drawn red"
    # the page's text above the graph (step, memory, axes, legend) inks both alike
    assert opened[0] > 1.2 * closed[0], "opening modules draws their ops"
    # .svg: the page's own drawing, standalone
    svg = tmp_path / "graph.svg"
    proc = autopar("viz", *model, "--open", "blocks", "-o", str(svg))
    assert proc.returncode == 0, proc.stderr
    drawing = svg.read_text()
    assert drawing.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<svg id="graph"')
    assert "blocks.0" in drawing and 'class="edge moved"' in drawing and "<style>" in drawing
    assert re.search(r"\+ \d+ ops, \d+ collectives?<", drawing), "a closed block counts its collectives"
    # transformers' Llama builds its causal mask in `model` itself: opened, those ops stay in one box
    llama = ["hf:llama", "num_hidden_layers=1", "hidden_size=32", "intermediate_size=64", "vocab_size=64"]
    proc = autopar("viz", *llama, "--mesh", "dp=2", "--open", "model", "-o", str(svg))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\+ \d+ own ops", svg.read_text())
    root = ElementTree.fromstring(drawing.split("\n", 1)[1])  # well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    # edge labels never overlap: their boxes (at 4.5 px a character: less than they take) are apart
    boxes = [
        (float(t.get("x")), float(t.get("y")), 4.5 * len(t.text))
        for t in root.iter("{http://www.w3.org/2000/svg}text")
        if t.get("class") in ("elabel", "llabel")
    ]
    assert len(boxes) > 20
    for i, (x, y, w) in enumerate(boxes):
        for u, v, wu in boxes[i + 1 :]:
            assert x + w <= u or u + wu <= x or abs(y - v) >= 9, (x, y, u, v)


def test_a_scaling_fit_says_how_well_it_fits():
    from autopar.tools.cli import _fit_words, _misfit, amdahl_fraction

    law = [{"devices": n, "speedup": 1 / (0.2 + 0.8 / n)} for n in (1, 2, 4, 8)]
    s = amdahl_fraction(law)
    fit = [1 / (s + (1 - s) / r["devices"]) for r in law]
    assert abs(s - 0.2) < 1e-9 and _fit_words(_misfit(law, "speedup", fit)) == "fits every point within 0%"
    dropped = [*law[:3], {"devices": 8, "speedup": 1.5}]  # the speedup falls off a cliff
    s = amdahl_fraction(dropped)
    off = _misfit(dropped, "speedup", [1 / (s + (1 - s) / r["devices"]) for r in dropped])
    assert off > 0.1 and _fit_words(off).startswith("a poor fit, off by up to")
