"""Smoke test of bench/memory.py's planning targets: one Llama-2-7B-shaped layer, no ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

REPO = Path(__file__).resolve().parents[1]


def test_memory_bench_plans_llama_and_names_the_minimum(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = [
        sys.executable,
        REPO / "bench" / "memory.py",
        "plan",
        "--layers=1",
        "--budgets=none,1e9",
        f"--json={out}",
    ]
    proc = subprocess.run([str(a) for a in args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    fits, too_small = json.loads(out.read_text())["results"]
    assert fits["total_GB"] < 80 and fits["zero"] == 0  # one layer fits the device without ZeRO
    assert "no plan fits memory_budget=0.93 GiB" in too_small["error"]
    assert "the least memory reached is" in too_small["error"] and "| 1 GB | error:" in proc.stdout
