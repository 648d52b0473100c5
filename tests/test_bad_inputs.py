"""A catalog of bad or unusual inputs, tried as a new user would: each gets an ``autopar.AutoparError``
of the right class whose message names what was given and what was expected.

Meshes, options (``Memory``, ``Pipeline``, clusters, budgets, time limits, seeds), example
inputs, saved plans against the model they are compiled for, and the command line (run
in-process: each mistake is one line on stderr and exit status 2, before any long work).
Annotation mistakes have their own tests (``test_annotations.py``, ``test_manual_split.py``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import autopar
from autopar import AnnotationError, CaptureError, OptionError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.tools import cli
from autopar.tools.fake_ranks import fake_world
from examples.mlp import build


def _mlp() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return build()


def _plan(mesh: object = None, args: object = None, **options: object) -> autopar.Plan:
    model, example = _mlp()
    return autopar.plan(
        model, example if args is None else args, {"dp": 2} if mesh is None else mesh, **options
    )


_LINK = autopar.LinkSpec(latency_s=1e-6, bandwidth_Bps=1e10)

MESHES = [
    ({"dp": 0}, "the size of mesh axis 'dp' must be an int >= 1, got 0"),
    ({"dp": 2.5}, "the size of mesh axis 'dp' must be an int >= 1, got 2.5"),
    ({"dp": True}, "got True"),
    ({"dp": "2"}, "got '2'"),
    ({}, "at least one axis"),
    ({"d-p": 2}, "mesh axis name 'd-p' must be an identifier"),
    ({3: 2}, "mesh axis name 3 must be an identifier"),
    ([2, 2], "expected a DeviceMesh, a MeshSpec or a mapping like {'dp': 2, 'tp': 4}, got list"),
    (0, "mesh as a device count must be a positive int, got 0"),
    (2.5, "got float"),
]


@pytest.mark.parametrize(("mesh", "message"), MESHES, ids=[repr(m) for m, _ in MESHES])
def test_a_bad_mesh_is_an_option_error(mesh, message):
    with pytest.raises(
        OptionError, match=message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")
    ):
        _plan(mesh)


def test_mesh_axes_are_named_once():
    with pytest.raises(OptionError, match=r"mesh axis names must be distinct, got \('dp', 'dp'\)"):
        MeshSpec(("dp", "dp"), (2, 2))


OPTIONS = [
    (lambda: autopar.Pipeline(0), r"Pipeline\(microbatches=...\) must be an int >= 1, got 0"),
    (lambda: autopar.Pipeline("4"), "got '4'"),
    (lambda: autopar.Pipeline(4, schedule="zb"), "unknown schedule 'zb'; schedules are"),
    (lambda: autopar.Pipeline(4, axis=3), r"Pipeline\(axis=...\) is the name of a mesh axis, got 3"),
    (lambda: autopar.Pipeline(4, virtual_stages=2), "virtual_stages=2 needs schedule='interleaved-1f1b'"),
    (lambda: autopar.Pipeline(4, schedule="interleaved-1f1b"), "needs virtual_stages >= 2"),
    (lambda: autopar.Memory(zero=5), r"Memory\(zero=...\) is a ZeRO stage 0, 1, 2 or 3 \(or None\), got 5"),
    (lambda: autopar.Memory(zero=True), "got True"),
    (lambda: autopar.Memory(zero=2.0), "got 2.0"),
    (
        lambda: autopar.Memory(zero_threshold="1MB"),
        r"Memory\(zero_threshold=...\) \(bytes per rank\) must be an int",
    ),
    (lambda: autopar.Memory(optimizer_states=-1), "must be an int >= 0, got -1"),
    (
        lambda: autopar.Memory(offload_optimizer="yes"),
        r"Memory\(offload_optimizer=...\) must be True or False",
    ),
    (lambda: autopar.Memory(offload_activations=1), "must be True or False, got 1"),
    (lambda: _plan(memory={"zero": 2}), "memory must be autopar.Memory"),
    (lambda: _plan(memory_budget="40GB"), r"memory_budget must be a number above 0 \(bytes per device"),
    (lambda: _plan(memory_budget=-1), "memory_budget must be a number above 0"),
    (lambda: _plan(memory_budget=math.inf), "got inf"),
    (lambda: _plan(time_limit=0), r"time_limit must be a number above 0 \(seconds of solver time\), got 0"),
    (lambda: _plan(time_limit="30"), "got '30'"),
    (lambda: _plan(time_limit=math.nan), "got nan"),
    (lambda: _plan(seed="x"), "seed must be an int >= 0, got 'x'"),
    (lambda: _plan(seed=1.5), "got 1.5"),
    (lambda: _plan(cluster="tpu-v9"), "got 'tpu-v9'; presets are"),
    (
        lambda: _plan(cluster=3),
        r"cluster must be a preset name, a cluster file \(.json, .*\) or an autopar.Cluster, got 3",
    ),
    (lambda: _plan(pipeline=4), "pipeline must be an autopar.Pipeline"),
    (
        lambda: _plan(args=[torch.randn(4, 8)]),
        "example_args is a list: give the positional inputs as a tuple",
    ),
    (lambda: _plan(example_kwargs=[1]), "example_kwargs must be a mapping of keyword inputs, got list"),
    (
        lambda: autopar.LinkSpec(latency_s=-1.0, bandwidth_Bps=1e9),
        "link needs latency >= 0 and bandwidth > 0",
    ),
    (
        lambda: autopar.Cluster("x", {"bfloat16": 1e12}, 1e12, 2**30, 8, _LINK, _LINK),
        "cluster 'x': peak_flops must have a 'float32' entry",
    ),
]


@pytest.mark.parametrize(("make", "message"), OPTIONS, ids=[str(i) for i in range(len(OPTIONS))])
def test_a_bad_option_is_an_option_error_and_nothing_is_coerced(make, message):
    with pytest.raises(OptionError, match=message):
        make()


PLANNING = [
    (
        lambda: _plan({"dp": 2}, pipeline=autopar.Pipeline(2)),
        PlanError,
        "the pipeline axis 'pp' is not an axis",
    ),
    (lambda: _plan({"dp": 1, "pp": 2}, pipeline=autopar.Pipeline(2)), PlanError, "must be the first"),
    (lambda: _plan({"pp": 2}), PlanError, "has an axis named 'pp', the pipeline axis"),
    (lambda: _plan({"pp": 2, "dp": 1}, pipeline=autopar.Pipeline(1)), PlanError, "'1f1b' needs at least"),
    (lambda: _plan(memory_budget=10), PlanError, "no plan fits memory_budget"),
    (lambda: autopar.plan(lambda x: x, (torch.randn(2),), {"dp": 2}), CaptureError, "plans an nn.Module"),
]


@pytest.mark.parametrize(("make", "kind", "message"), PLANNING, ids=[str(i) for i in range(len(PLANNING))])
def test_what_no_plan_can_satisfy_is_a_plan_or_capture_error(make, kind, message):
    with pytest.raises(kind, match=message):
        make()


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[torch.nonzero(x > 0)[:, 0]].sum()


def test_a_data_dependent_shape_is_a_capture_error_with_a_hint():
    with pytest.raises(CaptureError, match=r"makes a tensor whose size depends on the data .* Try: "):
        autopar.plan(_DataDependent(), (torch.randn(8),), {"dp": 2})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "holds a list, not a saved Plan"),
        ("{not json", "cannot read plan"),
        ('{"format": 1}', "format 1"),
    ],
)
def test_a_file_that_is_no_plan_is_a_plan_error(tmp_path, text, message):
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(PlanError, match=message):
        autopar.load_plan(tmp_path / "plan.json")


def test_a_plan_missing_a_field_names_it(tmp_path):
    data = _plan().to_dict()
    del data["input_shapes"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="malformed field 'input_shapes'"):
        autopar.load_plan(tmp_path / "plan.json")


def _compile(model: nn.Module, args: tuple, plan: autopar.Plan, names: tuple[str, ...] | None = ("dp",)):
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=names)
        return autopar.compile(model, mesh, args, plan=plan)


def test_a_saved_plan_must_fit_the_annotations_and_the_example_shapes():
    """A plan made before an annotation was added, or for another batch, is refused at compile."""
    model, args = _mlp()
    plan = _plan(args=args)
    annotated, _ = _mlp()
    autopar.shard(annotated.layers[0], parameter_plan={"weight": ("dp", None)})
    with pytest.raises(
        PlanError, match=r"other annotations \(parameter_plan layers.0.weight: none in the plan, S\(0\) now"
    ):
        _compile(annotated, args, plan)
    doubled = tuple(torch.cat([t, t]) for t in args)
    with pytest.raises(
        PlanError, match=r"input 'target' has shape \[8, 8\] but the plan was made for \[4, 8\]"
    ):
        _compile(model, doubled, plan)
    with pytest.raises(PlanError, match="the plan is for mesh dp=4, but the module is compiled for dp=2"):
        _compile(model, args, _plan({"dp": 4}, args))


def test_a_device_mesh_needs_axis_names():
    model, args = _mlp()
    with pytest.raises(OptionError, match="the DeviceMesh has no axis names"):
        _compile(model, args, None, names=None)


def test_zero_that_splits_nothing_says_so():
    plan = _plan({"tp": 2}, memory=autopar.Memory(zero=3))
    assert any("Memory(zero=3) splits nothing" in w for w in plan.warnings)


def test_a_time_limit_too_short_for_any_solution_returns_a_plan_and_its_gap():
    plan = _plan(time_limit=1e-9)
    assert plan.solver.status == "UNKNOWN" and plan.solver.gap > 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "hf:gpt2", "--mesh", "dp=2", "--budget", "1.2.3GB"], "budget '1.2.3GB': expected bytes"),
        (
            ["plan", "hf:gpt2", "--mesh", "dp=2", "-o", "/no/such/folder/p.json"],
            "there is no folder /no/such/folder",
        ),
        (["plan", "hf:gpt2", "--mesh", "dp=2", "--seq", "-1"], "argument --seq: '-1' is not a count"),
        (["plan", "hf:gpt2", "--mesh", "dp=2", "--batch", "0"], "argument --batch: '0' is not a count"),
        (["plan", "hf:gpt2", "--mesh", "dp=2,dp=2"], "each axis once"),
        (["plan", "hf:gpt2", "--mesh", "dp=0"], "mesh 'dp=0'"),
        (["plan", "hf:gpt2"], "one of the arguments --mesh --devices is required"),
        (["plan", "hf:gpt2", "--mesh", "dp=2", "--cluster", "tpu"], "got 'tpu'; presets are"),
        (["plan", "hf:gpt2", "n_layers=1", "--mesh", "dp=2"], "no field 'n_layers'; did you mean n_layer"),
        (["plan", "hf:gpt2", "n_layer", "--mesh", "dp=2"], "model option 'n_layer': expected key=value"),
        (["scaling", "hf:gpt2", "--devices", "1,x"], "devices '1,x': expected counts >= 1"),
        (
            ["viz", "hf:gpt2", "-o", "graph.png"],
            "viz writes a page (.html), an image (.svg) or Graphviz DOT (.dot)",
        ),
        (["explain", "nosuch.json", "node"], "cannot read plan nosuch.json"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_a_command_line_mistake_is_one_line_and_status_2(capsys, args, message):
    try:
        status = cli.main(args)
    except SystemExit as exit_:  # argparse's own checks exit
        status = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err


def test_a_model_file_that_fails_is_one_line(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("def build(:\n    pass\n")
    (tmp_path / "raises.py").write_text("def build():\n    raise RuntimeError('no GPU here')\n")
    assert cli.main(["plan", f"{tmp_path}/broken.py:build", "--mesh", "dp=2"]) == 2
    assert "broken.py failed: SyntaxError: " in capsys.readouterr().err
    assert cli.main(["plan", f"{tmp_path}/raises.py:build", "--mesh", "dp=2"]) == 2
    assert "build() failed: RuntimeError: no GPU here" in capsys.readouterr().err


def test_annotation_errors_stay_annotation_errors():
    model, _ = _mlp()
    with pytest.raises(AnnotationError):
        autopar.shard(model, in_strategy=(2, 1))


class _Holder(nn.Module):
    """A model holding one layer in a plain list (not one of its modules) and one never called."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.in_a_list = [nn.Linear(8, 8)]
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_a_list[0](self.first(x)).sum()


def test_an_annotation_that_could_not_apply_is_refused():
    model = _Holder()
    autopar.recompute(model.in_a_list[0])
    with pytest.raises(
        AnnotationError, match="Linear module annotated with recompute runs in the forward of _Holder"
    ):
        autopar.plan(model, (torch.randn(4, 8),), {"dp": 2})
    model = _Holder()
    autopar.shard(model.unused, out_strategy=(("dp", None),))
    with pytest.raises(AnnotationError, match="module 'unused' \\(Linear\\): shard\\(\\) gives in_strategy"):
        autopar.plan(model, (torch.randn(4, 8),), {"dp": 2})


def test_an_annotation_on_a_module_outside_the_model_is_reported_once():
    model, example = _mlp()
    stray = nn.Linear(4, 4)
    autopar.shard(stray, parameter_plan={"weight": ("dp", None)})
    plan = autopar.plan(model, example, {"dp": 2})
    assert "shard() on a Linear module that is not part of the MLP being planned is not applied to it" in (
        plan.warnings
    )
    assert not any("not part of" in w for w in autopar.plan(model, example, {"dp": 2}).warnings)


def test_a_model_on_meta_compiled_as_a_copy_keeps_its_annotations_its_own():
    from torch.distributed.device_mesh import init_device_mesh

    model, _ = build(device="meta")
    _, example = _mlp()
    autopar.shard(model.layers[0], parameter_plan={"weight": ("dp", None)})
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        compiled = autopar.compile(model, mesh, example)
    assert compiled.plan.parameters["layers.0.weight"] == "S(0)"
    assert not any("not part of" in w for w in compiled.plan.warnings)
