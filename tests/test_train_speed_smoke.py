"""Smoke test of bench/train_speed.py: a tiny model, two steps, one variant, 4 real gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.smoke
def test_train_speed_prints_a_row_and_checks_losses(tmp_path: Path) -> None:
    # ddp-tp-2x2 because it leans on the most torch machinery (2-D mesh, DTensor params under DDP),
    # so a torch upgrade that breaks any of the variants most likely breaks this one.
    out = tmp_path / "result.json"
    args = [
        sys.executable,
        REPO / "bench" / "train_speed.py",
        "--variants=ddp-tp-2x2",
        "--steps=2",
        "--warmup=0",
        "--vocab-size=64",
        "--seq-len=16",
        "--d-model=32",
        "--n-heads=4",
        "--n-layers=1",
        "--d-ff=64",
        "--batch-size=4",
        f"--json={out}",
    ]
    # A hung rendezvous fails the test instead of the whole run.
    proc = subprocess.run([str(a) for a in args], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"

    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("ddp-tp-2x2 ")]
    assert len(rows) == 1, proc.stdout
    # variant, mesh "dp=2 x tp=2", median ms, mean ms, tokens/s, then the first two losses unmarked
    name, *mesh, median_ms, _mean_ms, _tokens, loss1, loss2 = rows[0]
    assert mesh == ["dp=2", "x", "tp=2"]
    assert float(median_ms) > 0
    assert float(loss1) > float(loss2) > 0

    report = json.loads(out.read_text())
    assert report["losses_match"]
    result = report["variants"]["ddp-tp-2x2"]
    assert result["mesh"] == {"dp": 2, "tp": 2}
    assert len(result["step_ms"]) == 2
