"""Every script in bench/ starts as docs/benchmarks.md runs it: ``python bench/NAME.py``, whose
``sys.path`` holds bench/ and not the repository's root, so ``examples`` and ``bench`` must be
found by the script itself. One interpreter runs each script's ``--help`` in turn (imports paid
once), forgetting the repository's own modules between scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]

RUN_EACH = """
import runpy, sys
from pathlib import Path
root, bench = Path(sys.argv[1]), Path(sys.argv[1]) / "bench"
base = [p for p in sys.path if p not in ("", str(root))]
siblings = {p.stem for p in bench.glob("*.py")}
failed = []
for script in sorted(bench.glob("*.py")):
    for name in [m for m in sys.modules if m.split(".")[0] in {"examples", "bench", *siblings}]:
        del sys.modules[name]
    sys.path[:] = [str(bench), *base]
    sys.argv = [str(script), "--help"]
    try:
        runpy.run_path(str(script), run_name="__main__")
        failed.append(f"{script.name}: no --help")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{script.name}: exit {e.code}")
    except Exception as e:
        failed.append(f"{script.name}: {e!r}")
print("FAILED", failed)
"""


def test_every_bench_script_starts_as_its_docs_run_it(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", RUN_EACH, str(ROOT)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FAILED []" in done.stdout, done.stdout[-3000:]
