"""Cluster files: ``autopar calibrate`` measures this machine (gloo ranks all running at once)
into a JSON file that ``plan``, ``compile`` and ``--cluster`` take; a file that is missing,
malformed or from another machine is an ``OptionError`` saying which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autopar
from autopar import OptionError
from autopar.planning.cost import get_cluster, this_machine
from autopar.tools.cli import main
from examples import gpt


def _write(path: Path, **changes: object) -> str:
    data = {**get_cluster("cpu-gloo").to_dict(), "name": "calibrated", "measured_on": this_machine()}
    path.write_text(json.dumps({**data, **changes}))
    return str(path)


def test_a_cluster_file_is_a_cluster(tmp_path: Path):
    model, args = gpt.build()
    path = _write(tmp_path / "cluster.json", peak_flops={"float32": 1e9})
    plan = autopar.plan(model, args, {"dp": 2}, cluster=path)
    assert plan.cluster["name"] == "calibrated" and plan.cluster["measured_on"] == this_machine()
    slower = autopar.plan(model, args, {"dp": 2}).prediction.compute_s
    assert plan.prediction.compute_s > 10 * slower  # 1 GFLOP/s against the preset's 132


def test_bad_cluster_files_are_refused(tmp_path: Path):
    model, args = gpt.build()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (str(tmp_path / "missing.json"), "does not exist; measure this machine with `autopar calibrate -o"),
        (str(bad), "cannot be read as JSON"),
        (_write(tmp_path / "partial.json", intra_node=None), "is malformed: missing or bad field"),
        (_write(tmp_path / "other.json", measured_on="gpu-node-17"), "was measured on 'gpu-node-17', not on"),
    ]
    for path, message in cases:
        with pytest.raises(OptionError, match=message.replace("(", r"\(")):
            autopar.plan(model, args, {"dp": 2}, cluster=path)
    with pytest.raises(SystemExit) as usage:  # the command line says so in one line
        main(["plan", "examples/gpt.py:build", "--mesh", "dp=2", "--cluster", cases[0][0]])
    assert usage.value.code == 2


@pytest.mark.slow
def test_calibrate_measures_this_machine_into_a_file(tmp_path: Path, capsys):
    path = tmp_path / "cluster.json"
    assert main(["calibrate", "--ranks", "2", "-o", str(path)]) == 0
    assert f"cluster written to {path}" in capsys.readouterr().out
    cluster = get_cluster(str(path))
    assert cluster.measured_on == this_machine() and cluster.name == "calibrated"
    assert set(cluster.peak_flops) == {"float32", "bfloat16", "float16"}
    assert cluster.intra_node.bandwidth_Bps > 0
