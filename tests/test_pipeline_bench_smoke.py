"""Smoke test of bench/pipeline.py: a tiny model, one schedule, 2 real gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.smoke
def test_pipeline_bench_measures_what_the_plan_predicts(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = [
        sys.executable,
        REPO / "bench" / "pipeline.py",
        "--schedules=1f1b,interleaved-1f1b",
        "--microbatches=4",
        "--steps=1",
        "--vocab-size=64",
        "--seq-len=16",
        "--d-model=32",
        "--n-layers=4",
        "--d-ff=64",
        f"--json={out}",
    ]
    proc = subprocess.run([str(a) for a in args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "| 1f1b | 4 | 0 |" in proc.stdout and "| interleaved-1f1b | 4 | 1 |" in proc.stdout
    results = json.loads(out.read_text())["results"]
    for rank in results:
        for case in rank:
            # the schedules hold exactly as many microbatches as the memory model says
            assert case["peak_in_flight"] == case["predicted"]["in_flight"], case
            assert 0 < case["busy_s"] < case["step_s"]
