"""Bad inputs around cluster files, ``ManualSplit`` and ``Parts``, ``compile``'s entry and the
command line, tried as a new user would: each is an ``autopar.AutoparError`` of the right class (a
command-line mistake: one line on stderr and status 2) whose message names what was given and what
is expected, nothing coerced; a device count of 10**20 is searched without enumerating its range.

In-process: annotations need no ranks, compiled-module calls run on a fake process group.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import autopar
from autopar import AnnotationError, CompileError, ManualSplit, OptionError, Parts
from autopar.planning.cost.model import get_cluster
from autopar.planning.search.mesh_search import candidate_meshes
from autopar.tools import cli
from autopar.tools.fake_ranks import fake_world
from examples.mlp import build
from examples.recommender import build as build_recommender
from tests.test_bad_inputs import _assert_one_line_and_status_2

# ----------------------------------------------------------------------------- annotations


@pytest.mark.parametrize(
    ("parts", "shown"),
    [([2, 4], r"parts=\[2, 4\]"), ("3", "parts='3'"), (float("nan"), "parts=nan"), (2.0, "parts=2.0")],
)
def test_parts_that_are_no_count_nor_tuple_of_sizes_are_refused(parts, shown):
    with pytest.raises(AnnotationError, match=rf"dim 0: Parts\(axis='tp', {shown}\) needs a mesh axis name"):
        autopar.shard(nn.Linear(4, 6), parameter_plan={"weight": (Parts("tp", parts), None)})


def test_a_table_takes_one_manual_split():
    """A second ManualSplit's rows would otherwise be dropped for DTensor's even pieces."""
    split = (ManualSplit("tp", (700, 300)), ManualSplit("dp", (10, 6)))
    with pytest.raises(AnnotationError, match=r"dims \[0, 1\] are each given a ManualSplit; a table's rows"):
        autopar.shard(nn.Embedding(1000, 16), parameter_plan={"weight": split})


@pytest.mark.parametrize("rows", [(np.int64(700), np.int64(300)), (700.0, 300.0), (True, 999)])
def test_manual_split_rows_are_python_ints(rows):
    model, inputs, _ = build_recommender()
    with pytest.raises(AnnotationError, match=r"must be ints >= 0 \(Python ints: not bools, floats or numpy"):
        autopar.shard(model.users, parameter_plan={"weight": (ManualSplit("tp", rows), None)})


# ----------------------------------------------------------------------------- cluster files


def _cluster_file(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "cluster.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def test_a_cluster_file_that_is_no_utf8_json_a_folder_or_repeats_a_key_is_an_option_error(tmp_path):
    path = _cluster_file(tmp_path, b"\xff\xfe\x00\x01")
    with pytest.raises(OptionError, match=f"cluster file {path} cannot be read as JSON: 'utf-8' codec"):
        get_cluster(path)
    good = get_cluster("cpu-gloo").to_dict()
    text = json.dumps({**good, "name": "a"})[:-1] + ', "name": "b"}'
    with pytest.raises(OptionError, match=r"key 'name' is given twice in one object; give each field once"):
        get_cluster(_cluster_file(tmp_path, text))
    folder = tmp_path / "measured.json"
    folder.mkdir()
    with pytest.raises(
        OptionError, match=f"cluster file {folder} is a folder; give the .json file inside it"
    ):
        get_cluster(str(folder))


def test_a_cluster_file_as_a_path_object_loads_and_a_preset_in_another_case_is_named(tmp_path):
    path = Path(_cluster_file(tmp_path, json.dumps(get_cluster("fast-links").to_dict())))
    assert get_cluster(path) == get_cluster(str(path))
    with pytest.raises(OptionError, match=r"got 'CPU-GLOO'; .* case-sensitive: did you mean 'cpu-gloo'\?"):
        get_cluster("CPU-GLOO")


# ----------------------------------------------------------------------------- entry points


def test_compile_takes_an_nn_module_and_example_args_a_tuple():
    torch.manual_seed(0)
    model, example = build()
    with pytest.raises(CompileError, match=r"autopar.compile compiles an nn.Module, got str 'model'"):
        autopar.compile("model", None, example)
    with pytest.raises(OptionError, match=r"example_args is a mapping: .* keyword inputs as example_kwargs="):
        autopar.plan(model, {"x": example[0]}, {"dp": 2})


def test_train_step_takes_a_callable_loss():
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, (x, target) = build()
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        dmodel = autopar.compile(model, mesh, (x, target), cluster="fast-links")
        with pytest.raises(
            OptionError, match=r"loss_fn must be a function loss_fn\(output, target\), got str"
        ):
            dmodel.train_step(x, target, "mse")


def test_a_device_count_of_ten_to_the_twenty_is_searched_in_no_time():
    t0 = time.perf_counter()
    meshes = candidate_meshes(10**20, get_cluster("h100"), blocks=4, batch=8, pipeline=None)
    assert time.perf_counter() - t0 < 0.5
    assert ({"dp": 10**20 // 8, "tp": 8}, None) in meshes
    assert all(sizes.get("tp", 1) <= 8 and sizes.get("pp", 1) <= 4 for sizes, _ in meshes)


# ----------------------------------------------------------------------------- the command line

M = "examples/mlp.py:build"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", M, "--mesh", "dp=²"], "mesh 'dp=²': expected axis=size items"),
        (["plan", M, "--devices", "٤"], "argument --devices: '٤' is not a count: expected a whole number"),
        (["plan", "hf:gpt2", "--mesh", "dp=2", "--seq", "²"], "argument --seq: '²' is not a count"),
        (["plan", M, "--mesh", "dp=2", "--width", "٤٠"], "width '٤٠': expected a whole number of characters"),
        (["scaling", M, "--devices", "1,²"], "devices '1,²': expected counts >= 1"),
        (
            ["scaling", M, "--devices", "1,2,2"],
            "devices '1,2,2': 2 is given twice; give each device count once",
        ),
        (
            ["scaling", M, "--devices", "1,2", "--plot", "s.txt"],
            "plot s.txt: expected a .png or .svg file name",
        ),
        (
            ["plan", M, "--mesh", "dp=2", "--batch", "64"],
            "--batch 64 size the example batch of hf: models only; a factory makes its own example inputs",
        ),
        (["plan", M, "--mesh", "dp=2", "--seq", "16"], "--seq 16 size the example batch of hf: models only"),
        (
            ["plan", "examples/megatron_gpt2.py:build", "--mesh", "dp=2"],
            "build returned its example args as dict; it must return (model, args) or (model, args, kwargs)",
        ),
        (
            ["plan", "examples/recommender.py:build", "--mesh", "dp=2"],
            "build returned its example kwargs as Tensor",
        ),
    ],
)
def test_a_command_line_mistake_is_one_line_and_status_2(capsys, args, message):
    _assert_one_line_and_status_2(capsys, args, message)


def test_stragglers_count_a_factory_model_s_own_batch(capsys):
    assert cli.main(["plan", M, "batch_size=6", "--mesh", "dp=2", "--stragglers", "1,2"]) == 0
    assert re.search(r"replicas slowed \[1\.0, 2\.0\], 6 samples per step", capsys.readouterr().out)
