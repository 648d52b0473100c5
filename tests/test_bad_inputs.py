"""A catalog of bad or unusual inputs, tried as a new user would: each gets an ``autopar.AutoparError``
of the right class whose message names what was given and what was expected; nothing is coerced,
and no NaN or inf is taken where a finite figure is expected.

Meshes, options (``Memory``, ``Pipeline``, clusters, budgets, time limits, seeds), example
inputs, saved plans against the model they are compiled for, the command line (run in-process:
each mistake is one line on stderr and exit status 2, before any long work), compiled modules
called wrongly, and the runtime's options: cluster files, the loss scaler, the step meter and
the update modes. In-process but for one 2-rank gloo world, in which ranks call
``StepMeter.step()`` apart and each gets a ``CollectiveMismatchError`` within seconds.
Annotation mistakes have their own tests (``test_annotations.py``, ``test_manual_split.py``),
checkpoints theirs (``test_checkpoint_safety.py``), ids out of range ``test_id_range.py``.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar import (
    AnnotationError,
    CaptureError,
    CheckpointError,
    CollectiveMismatchError,
    OptionError,
    PlanError,
    ShapeError,
)
from autopar.ir.mesh import MeshSpec
from autopar.planning.cost.cluster import AttentionRates
from autopar.planning.cost.model import Cluster, LinkSpec, get_cluster
from autopar.runtime.async_updates import ServerRank
from autopar.runtime.loss_scaler import MAX_SCALE
from autopar.tools import cli
from autopar.tools.fake_ranks import fake_world
from autopar.tools.launch import spawn
from autopar.tools.telemetry import StepMeter
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
        r"LinkSpec latency_s must be a number >= 0 \(seconds per message\), got -1.0",
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
        ('{"name": "h100"}', "this is not a plan autopar saved: it has no 'format' field"),
        (
            '{"name": "mine", "peak_flops": {}}',
            "a cluster file, by its fields: give it as cluster= or --cluster",
        ),
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
    _assert_one_line_and_status_2(capsys, args, message)


def _assert_one_line_and_status_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
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


# --- issue 42: nothing lost, nothing silently wrong (annotations, example inputs, the compiled
# module's door, the command line)


class _TiedHead(nn.Module):
    """A table tied to the output projection of another module (as GPT-2's wte and lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).sum()


def _ids() -> torch.Tensor:
    return torch.randint(0, 20, (4, 3))


@pytest.mark.parametrize(("owner", "other"), [("embed", "head"), ("head", "embed")])
def test_a_manual_split_on_a_tied_table_is_refused_naming_the_other_reader(owner, other):
    model = _TiedHead()
    autopar.shard(
        getattr(model, owner), parameter_plan={"weight": (autopar.ManualSplit("tp", (12, 8)), None)}
    )
    with pytest.raises(AnnotationError) as error:
        autopar.plan(model, (_ids(),), {"tp": 2})
    message = str(error.value)
    assert (
        f"ManualSplit splits parameter '{owner}.weight' in rows of its own, but the parameter is tied"
        in message
    )
    assert f"it is also '{other}.weight' of module '{other}'" in message
    assert "split it by the axis name instead (parameter_plan ('tp', None)" in message


def test_an_annotation_on_a_tied_weight_holds_under_each_of_its_names():
    """Export may read a tied weight under its second name; the annotation made under the first
    still pins it (it was dropped without a word), and a ManualSplit's rows are always held split."""
    for owner in ("embed", "head"):
        model = _TiedHead()
        autopar.shard(getattr(model, owner), parameter_plan={"weight": ("tp", None)})
        plan = autopar.plan(model, (_ids(),), {"tp": 2})
        assert plan.parameters["embed.weight"] == plan.parameters["head.weight"] == "S(0)", owner
    from examples.recommender import annotate
    from examples.recommender import build as recommender

    model, inputs, _ = recommender()
    annotate(model)
    plan = autopar.plan(model, inputs, {"dp": 2, "tp": 2}, cluster="fast-links")
    assert plan.manual_rows  # every table with rows is held split on its rows' axis: never padded whole
    for fqn, (dim, _) in plan.manual_rows.items():
        assert f"S({dim})" in plan.parameters[fqn], (fqn, plan.parameters[fqn])


def test_an_annotation_lost_with_a_replaced_module_is_refused():
    model, example = _mlp()
    autopar.shard(model.layers[0], parameter_plan={"weight": ("dp", None)})
    model.layers[0] = nn.Linear(16, 64)
    with pytest.raises(
        AnnotationError,
        match=r"module 'layers.0' was a Linear annotated with shard, then replaced by a Linear, so the "
        r"annotated module is no longer part of the MLP .* annotate the module now at 'layers.0'",
    ):
        autopar.plan(model, example, {"dp": 2})
    autopar.recompute(model.layers[0])  # the new module annotated: nothing is lost
    assert autopar.plan(model, example, {"dp": 2}).annotations == {"recompute layers.0": "full"}
    model, _ = _mlp()
    autopar.recompute(model.layers[1])
    model.layers[1] = nn.Sequential(model.layers[1])  # wrapped: the annotated module still runs
    autopar.plan(model, example, {"dp": 2})


def test_recompute_on_a_module_whose_forward_never_runs_is_refused():
    model = _Holder()
    autopar.recompute(model.unused)
    with pytest.raises(
        AnnotationError,
        match=r"module 'unused' \(Linear\): recompute\(\) is set on it, but its forward never runs",
    ):
        autopar.plan(model, (torch.randn(4, 8),), {"dp": 2})
    model, example = _mlp()
    autopar.recompute(model.layers)
    with pytest.raises(
        AnnotationError, match=r"module 'layers' \(ModuleList\).* annotate each block it holds"
    ):
        autopar.plan(model, example, {"dp": 2})


def test_example_inputs_a_plan_cannot_be_made_for_are_named():
    model, (x, target) = _mlp()
    with pytest.raises(
        OptionError, match=r"example input 'x' \(position 0\) has shape \(0, 16\): dim 0 is empty \(size 0\)"
    ):
        autopar.plan(model, (x[:0], target[:0]), {"dp": 2})
    with pytest.raises(
        CaptureError,
        match=r"must be Tensor, not NoneType. Try: give a tensor for example input 'x' \(position 0\)",
    ):
        autopar.plan(model, (None,), {"dp": 2})
    assert autopar.plan(model, (x, None), {"dp": 2}).inputs  # None where the forward accepts it
    with pytest.raises(
        OptionError,
        match=r"op aten.linear.default in module 'layers.0' computes on operands of dtypes torch.float64, "
        r"torch.float32, torch.float32 \(example input .x. \(position 0\) is torch.float64\), which",
    ):
        autopar.plan(model, (x.double(), target.double()), {"dp": 2})
    table = nn.Embedding(20, 8)
    for bad, shown in ((20, "id 20"), (-1, "id -1")):
        ids = _ids()
        ids[1, 2] = bad
        with pytest.raises(
            OptionError,
            match=rf"example input 'input' \(position 0\) holds {shown}, but module '<root>' looks it up in "
            r"a table of 20 rows: ids must be in \[0, 20\)",
        ):
            autopar.plan(table, (ids,), {"dp": 2})


def test_a_compiled_module_names_what_it_is_called_with_wrongly():
    """Checked at the module's door, before the program runs (dtype, None, a missing input), and a
    DeviceMesh whose ranks the world does not have."""
    from torch.distributed.device_mesh import init_device_mesh

    model, (x, target) = _mlp()
    with fake_world(4):
        four = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.raises(autopar.CompileError, match=r"the DeviceMesh dp=4 \(4 ranks\) needs a process group"):
        autopar.compile(model, four, (x, target))
    with fake_world(2):
        with pytest.raises(
            autopar.CompileError,
            match=r"the DeviceMesh dp=4 holds 4 ranks \(up to rank 3\), but the world has 2",
        ):
            autopar.compile(model, four, (x, target))
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        dmodel = autopar.compile(model, mesh, (x, target))
        local, _ = dmodel.shard_inputs(x, target)
        cases = [
            (
                lambda: dmodel.shard_inputs(x),
                r"input 'target' \(position 1\) is missing: the module was compiled with 2 positional inputs "
                r"\('x', 'target'\), got 1",
            ),
            (
                lambda: dmodel.shard_inputs(x, target, x),
                "got 3 positional inputs, but the module was compiled",
            ),
            (
                lambda: dmodel(*(t.double() for t in local)),
                r"input 'x' has dtype torch.float64, but the module was compiled for torch.float32",
            ),
            (
                lambda: dmodel(local[0], None),
                r"input 'target' is None, but the module was compiled with a tensor there \(torch.float32",
            ),
            (
                lambda: dmodel.shard_inputs(x, [target]),
                r"input 'target' \(position 1\) is a list of 1, but the module was compiled with a single",
            ),
        ]
        for call, message in cases:
            with pytest.raises(autopar.ShapeError, match=message):
                call()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "hf:gpt2", "n_embd=65", "n_head=4", "--mesh", "dp=2"], "transformers cannot build it: "),
        (
            ["plan", "hf:gpt2", "n_positions=64", "--seq", "128", "--mesh", "dp=2"],
            "--seq 128 is longer than its n_positions = max_position_embeddings (64 positions): give",
        ),
        (
            ["plan", "hf:gpt2", "vocab_size=0", "--mesh", "dp=2"],
            "config field vocab_size=0: expected an int >= 1",
        ),
        (
            ["plan", "hf:gpt2", "n_layer=2.5", "--mesh", "dp=2"],
            "config field n_layer=2.5: expected an int >= 1",
        ),
        (["plan", "hf:gpt2", "n_layer=True", "--mesh", "dp=2"], "n_layer=True: expected an int >= 1"),
        (
            ["plan", "hf:gpt2", "layer_norm_epsilon=nan", "--mesh", "dp=2"],
            "config field layer_norm_epsilon=nan: expected a finite number",
        ),
        (["plan", "hf:gpt2", "scale_attn_weights=1", "--mesh", "dp=2"], "expected True or False"),
        (["plan", "hf:gpt2", "n_layer=1", "n_layer=2", "--mesh", "dp=2"], "'n_layer' is given twice"),
        (
            ["plan", "hf:gpt2", "--mesh", "dp=2", "--width", "5"],
            "expected a whole number of characters >= 40",
        ),
        (["plan", "hf:gpt2", "--mesh", "dp=2", "-o", "/"], "cannot write /: it is a folder"),
    ],
)
def test_a_model_option_or_flag_that_cannot_hold_is_one_line_and_status_2(capsys, args, message):
    _assert_one_line_and_status_2(capsys, args, message)


def test_an_output_that_cannot_be_written_is_one_line_and_status_2(tmp_path, capsys):
    saved = tmp_path / "plan.json"
    _plan().save(saved)
    for args in (
        ["viz", str(saved), "-o", "/proc/g.html"],
        ["plan", "examples/mlp.py:build", "--mesh", "dp=2", "-o", "/proc/p.json"],
    ):
        _assert_one_line_and_status_2(capsys, args, f"cannot write {args[-1]}: No such file or directory")


# Cluster files, the loss scaler, the step meter and the update modes (the runtime's options)

_LINK_FIELDS = {"latency_s": 1e-4, "bandwidth_Bps": 1e9}
_GOOD = LinkSpec(1e-6, 1e10)


def _file(tmp_path: Path, changes: dict, drop: tuple[str, ...] = ()) -> str:
    data = {**get_cluster("cpu-gloo").to_dict(), "name": "calibrated", **changes}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if k not in drop}))
    return str(path)


CLUSTER_FILES = [
    (
        {"peak_flops": {"float32": 1e9, "bf16": 1e12}},
        "peak_flops: unknown key 'bf16'; did you mean 'bfloat16'?",
    ),
    ({"peak_flops": {"float32": 1e9, "fp16": 1e12}}, "unknown key 'fp16'; did you mean 'float16'?"),
    ({"peak_flops": {"float32": 1e9, "half": 1e12}}, "unknown key 'half'; did you mean 'float16'?"),
    ({"peak_flops": {"fp32": 1e9}}, "unknown key 'fp32'; did you mean 'float32'?"),
    ({"peak_flops": {"float": 1e9}}, "unknown key 'float'; did you mean 'float32'?"),
    (
        {"peak_flops": {"float32": math.nan}},
        "peak_flops['float32'] must be a number above 0 (FLOP/s), got nan",
    ),
    (
        {"peak_flops": {"float32": "1e9"}},
        "peak_flops['float32'] must be a number above 0 (FLOP/s), got '1e9'",
    ),
    ({"peak_flops": [1e9]}, "peak_flops must be a mapping"),
    ({"asynchronous": "false"}, "asynchronous must be True or False, got 'false'"),
    ({"asynchronous": 0}, "asynchronous must be True or False, got 0"),
    ({"devices_per_node": 2.5}, "devices_per_node must be an int >= 1, got 2.5"),
    ({"devices_per_node": True}, "devices_per_node must be an int >= 1, got True"),
    ({"memory_bytes": 8e10}, "memory_bytes (bytes per device) must be an int >= 1, got 80000000000.0"),
    (
        {"memory_bandwidth_Bps": math.nan},
        "memory_bandwidth_Bps must be a number above 0 (bytes per second), got nan",
    ),
    ({"op_overhead_s": math.inf}, "op_overhead_s must be a number >= 0 (seconds per op), got inf"),
    ({"straggler_s": -1e-3}, "straggler_s must be a number >= 0 (seconds), got -0.001"),
    ({"ranks_per_core": 0.5}, "ranks_per_core must be a number >= 1 (ranks sharing one core), got 0.5"),
    (
        {"host_link_Bps": 0},
        "host_link_Bps must be a number above 0 (bytes per second, one direction; or None)",
    ),
    ({"threads_per_rank": 2.0}, "threads_per_rank (or None) must be an int >= 1, got 2.0"),
    ({"name": 3}, "a cluster's name must be a string, got int 3"),
    ({"measured_on": 7}, "measured_on must be a host name (a string), got int 7"),
    ({"asynchronus": True}, "cluster: unknown key 'asynchronus'; did you mean 'asynchronous'?"),
    (
        {"intra_node": {**_LINK_FIELDS, "latency_s": math.nan}},
        "intra_node: LinkSpec latency_s must be a number >= 0",
    ),
    (
        {"inter_node": {**_LINK_FIELDS, "bandwidth_Bps": math.inf}},
        "inter_node: LinkSpec bandwidth_Bps must be a number",
    ),
    ({"intra_node": {"latency_s": 1e-4, "bandwith_Bps": 1e9}}, "unknown key 'bandwith_Bps'; did you mean"),
    ({"intra_node": {"latency_s": 1e-4}}, "intra_node lacks 'bandwidth_Bps'"),
    ({"intra_node": None}, "intra_node must be a mapping"),
    (
        {"intra_node": {**_LINK_FIELDS, "collectives": {"allreduce": _LINK_FIELDS}}},
        "intra_node.collectives: unknown key 'allreduce'; did you mean 'all_reduce'?",
    ),
    (
        {"intra_node": {**_LINK_FIELDS, "collectives": {"all_gather": {**_LINK_FIELDS, "latency_s": -1}}}},
        "intra_node.collectives.all_gather: LinkSpec latency_s must be a number >= 0",
    ),
    (
        {"function_rates": {"gelu_bwd": 1e9}},
        "function_rates: unknown key 'gelu_bwd'; did you mean 'gelu_backward'?",
    ),
    ({"function_rates": {"gelu": math.inf}}, "function_rates['gelu'] must be a number above 0"),
    (
        {"attention": {"flop_scale": 1.2, "score_s": 1e-9, "causal_blok": 512}},
        "attention: unknown key 'causal_blok'; did you mean 'causal_block'?",
    ),
    (
        {"attention": {"flop_scale": math.nan, "score_s": 1e-9, "causal_block": 512}},
        "attention: AttentionRates flop_scale must be a number above 0",
    ),
]


@pytest.mark.parametrize(
    ("changes", "message"), CLUSTER_FILES, ids=[str(i) for i in range(len(CLUSTER_FILES))]
)
def test_a_bad_cluster_file_names_the_file_the_field_and_what_it_takes(tmp_path, changes, message):
    path = _file(tmp_path, changes)
    with pytest.raises(OptionError, match=re.escape(message)) as error:
        get_cluster(path)
    assert f"cluster file {path}" in str(error.value)


def test_a_cluster_file_lacking_a_field_or_not_an_object_says_so(tmp_path):
    with pytest.raises(OptionError, match="cluster lacks 'inter_node'"):
        get_cluster(_file(tmp_path, {}, drop=("inter_node",)))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(OptionError, match=r"cluster must be a mapping \(a dict; in a file, a JSON object\)"):
        get_cluster(str(tmp_path / "list.json"))


def test_every_preset_still_round_trips_through_its_file():
    for name in ("cpu-gloo", "h100", "fast-links"):
        assert Cluster.from_dict(json.loads(json.dumps(get_cluster(name).to_dict()))) == get_cluster(name)


CONSTRUCTORS = [
    (lambda: LinkSpec(True, 1e9), "LinkSpec latency_s must be a number >= 0 (seconds per message), got True"),
    (lambda: LinkSpec(1e-6, math.inf), "LinkSpec bandwidth_Bps must be a number above 0"),
    (lambda: LinkSpec(1e-6, "1e9"), "got '1e9'"),
    (lambda: LinkSpec(1e-6, 1e9, [1]), "LinkSpec collectives must be a mapping"),
    (lambda: AttentionRates(1.0, math.nan, 0.0), "AttentionRates score_s must be a number >= 0"),
    (
        lambda: Cluster("x", {"float32": 1e12, "bf16": 1e12}, 1e12, 2**30, 8, _GOOD, _GOOD),
        "did you mean 'bfloat16'",
    ),
    (lambda: Cluster("x", {"float32": 1e12}, math.nan, 2**30, 8, _GOOD, _GOOD), "memory_bandwidth_Bps"),
    (
        lambda: Cluster("x", {"float32": 1e12}, 1e12, 2**30, 2.5, _GOOD, _GOOD),
        "devices_per_node must be an int",
    ),
    (lambda: Cluster("x", {"float32": 1e12}, 1e12, True, 8, _GOOD, _GOOD), "memory_bytes (bytes per device)"),
    (
        lambda: Cluster("x", {"float32": 1e12}, 1e12, 2**30, 8, _LINK_FIELDS, _GOOD),
        "intra_node must be an autopar.LinkSpec",
    ),
    (
        lambda: Cluster("x", {"float32": 1e12}, 1e12, 2**30, 8, _GOOD, _GOOD, asynchronous="false"),
        "asynchronous must be True or False, got 'false'",
    ),
    (
        lambda: Cluster("x", {"float32": 1e12}, 1e12, 2**30, 8, _GOOD, _GOOD, attention={"flop_scale": 1}),
        "attention must be AttentionRates or None",
    ),
]


@pytest.mark.parametrize(("make", "message"), CONSTRUCTORS, ids=[str(i) for i in range(len(CONSTRUCTORS))])
def test_cluster_constructors_take_nothing_coerced_or_non_finite(make, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        make()


def test_a_misspelt_dtype_in_a_cluster_file_is_one_line_and_status_2_on_the_command_line(tmp_path, capsys):
    path = _file(tmp_path, {"peak_flops": {"float32": 1e9, "bf16": 1e12}})
    try:
        status = cli.main(["plan", "hf:gpt2", "--mesh", "dp=2", "--cluster", path])
    except SystemExit as exit_:  # argparse's own checks exit
        status = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert f"cluster file {path}" in err[0] and "unknown key 'bf16'; did you mean 'bfloat16'?" in err[0]


SCALERS = [
    ({"init_scale": math.inf}, "LossScaler(init_scale=...) must be a number above 0, got inf"),
    ({"init_scale": math.nan}, "got nan"),
    ({"init_scale": "65536"}, "LossScaler(init_scale=...) must be a number above 0, got '65536'"),
    ({"init_scale": True}, "got True"),
    ({"init_scale": 0}, "got 0"),
    ({"init_scale": 1e39}, "must be at most 3.403e+38 (float32's largest"),
    ({"growth_factor": math.inf}, "LossScaler(growth_factor=...) must be a number above 1, got inf"),
    ({"growth_factor": 1.0}, "LossScaler(growth_factor=...) must be a number above 1, got 1.0"),
    ({"growth_factor": True}, "got True"),
    ({"backoff_factor": 1}, "LossScaler(backoff_factor=...) must be a number above 0 and below 1, got 1"),
    ({"backoff_factor": 0.0}, "got 0.0"),
    ({"backoff_factor": math.nan}, "got nan"),
    ({"growth_interval": True}, "LossScaler(growth_interval=...) must be an int >= 1, got True"),
    ({"growth_interval": 2000.0}, "got 2000.0"),
    ({"growth_interval": 0}, "got 0"),
]


@pytest.mark.parametrize(("options", "message"), SCALERS, ids=[str(o) for o, _ in SCALERS])
def test_a_loss_scaler_takes_finite_figures_in_range_and_ints_that_are_not_bools(options, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        autopar.LossScaler(**options)


_STATE = {"scale": 1024.0, "good_steps": 3, "skipped_steps": 1}
SCALER_STATES = [
    ({}, "LossScaler.load_state_dict(state) lacks 'scale', 'good_steps', 'skipped_steps'"),
    ([1024.0], "LossScaler.load_state_dict(state) must be a mapping"),
    ({**_STATE, "scal": 1.0}, "unknown key 'scal'; did you mean 'scale'?"),
    (
        {**_STATE, "scale": math.inf},
        "LossScaler.load_state_dict(state): 'scale' must be a number above 0, got inf",
    ),
    ({**_STATE, "scale": "1024"}, "got '1024'"),
    ({**_STATE, "good_steps": 1.5}, "'good_steps' must be an int >= 0, got 1.5"),
    ({**_STATE, "skipped_steps": -1}, "'skipped_steps' must be an int >= 0, got -1"),
]


@pytest.mark.parametrize(("state", "message"), SCALER_STATES, ids=[str(i) for i in range(len(SCALER_STATES))])
def test_a_loss_scaler_state_is_checked_whole_before_it_changes_anything(state, message):
    scaler = autopar.LossScaler()
    with pytest.raises(OptionError, match=re.escape(message)):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == {"scale": 2.0**16, "good_steps": 0, "skipped_steps": 0}


def _good_step(scaler: autopar.LossScaler) -> None:
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    assert scaler.step(torch.optim.SGD([p], lr=0.1))
    scaler.update()


def test_the_scale_stays_finite_and_grows_after_a_state_saved_with_a_longer_interval():
    scaler = autopar.LossScaler(init_scale=2.0**100, growth_factor=2.0**100, growth_interval=1)
    _good_step(scaler)
    _good_step(scaler)
    assert scaler.scale_value == MAX_SCALE  # 2**200 is past float32: every scaled loss would be inf
    scaler = autopar.LossScaler(growth_interval=2)
    scaler.load_state_dict({"scale": 8.0, "good_steps": 5, "skipped_steps": 0})
    _good_step(scaler)
    assert scaler.state_dict() == {"scale": 16.0, "good_steps": 0, "skipped_steps": 0}
    with pytest.raises(OptionError, match=r"LossScaler's optimizer must be a torch optimizer"):
        scaler.step(nn.Linear(2, 2))


@pytest.fixture(scope="module")
def compiled():
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, args = build()
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        dmodel = autopar.compile(model, mesh, args)
        return dmodel, dmodel.optimizer(torch.optim.SGD, lr=0.1)


METERS = [
    (
        lambda m, o: StepMeter(nn.Linear(2, 2)),
        "StepMeter(module) measures the module autopar.compile returned",
    ),
    (lambda m, o: StepMeter(o, m), "got SGD; the module comes first: StepMeter(dmodel, optimizer)"),
    (lambda m, o: StepMeter(m, "adam"), "StepMeter(optimizer) must be the module's optimizer"),
    (
        lambda m, o: StepMeter(m, o, tokens=-64),
        "StepMeter(tokens=...) (tokens per step) must be an int >= 1, got -64",
    ),
    (lambda m, o: StepMeter(m, o, tokens="64"), "got '64'"),
    (lambda m, o: StepMeter(m, o, tokens=True), "got True"),
    (
        lambda m, o: StepMeter(m, o, samples=2.0),
        "StepMeter(samples=...) (samples per step) must be an int >= 1",
    ),
    (lambda m, o: StepMeter(m, o, tokens=64, samples=4), "StepMeter counts tokens or samples, not both"),
    (lambda m, o: StepMeter(m, o, jsonl=3), "StepMeter(jsonl=...) must be a path (a str or a Path) or None"),
    (lambda m, o: StepMeter(m, o, echo="yes"), "StepMeter(echo=...) must be True or False"),
    (lambda m, o: StepMeter(m, o, timeout_s=0), "StepMeter(timeout_s=...) must be a number above 0"),
    (lambda m, o: StepMeter(m, o, timeout_s=math.inf), "got inf"),
    (lambda m, o: StepMeter(m, o), "call torch.distributed.init_process_group(...) before"),
]


@pytest.mark.parametrize(("make", "message"), METERS, ids=[str(i) for i in range(len(METERS))])
def test_a_step_meter_checks_its_arguments_before_any_step(compiled, make, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        make(*compiled)


def test_a_step_meter_file_must_be_writable_where_it_is_made(compiled, tmp_path):
    dmodel, optimizer = compiled
    with fake_world(2):
        with pytest.raises(OptionError, match=re.escape("there is no folder /missing/dir")) as error:
            StepMeter(dmodel, optimizer, jsonl="/missing/dir/x.jsonl")
        assert "StepMeter(jsonl='/missing/dir/x.jsonl') cannot be appended to" in str(error.value)
        with pytest.raises(OptionError, match="cannot be appended to"):
            StepMeter(dmodel, optimizer, jsonl=tmp_path)  # a folder
        StepMeter(dmodel, optimizer, jsonl=tmp_path / "steps.jsonl")
    assert (tmp_path / "steps.jsonl").read_text() == ""


UPDATES = [
    (
        lambda: autopar.Async(servers=True),
        OptionError,
        "Async(servers=...) (server ranks) must be an int >= 1",
    ),
    (lambda: autopar.Async(staleness=math.nan), OptionError, "Async(staleness=...) is the clocks"),
    (
        lambda: autopar.Hybrid(groups=2.0),
        OptionError,
        "Hybrid(groups=...) (groups of replicas) must be an int",
    ),
    (lambda: autopar.ParameterServer(axis=3), OptionError, "ParameterServer(axis=...) is the name of"),
    (lambda: autopar.rejoin_mesh(autopar.Async(), {"dp": 4}, rank=1.5), OptionError, "rank=...) (the rank"),
    (
        lambda: autopar.rejoin_mesh(autopar.Async(), {"dp": 4}, rank=True),
        OptionError,
        "must be an int >= 0, got True",
    ),
    (
        lambda: autopar.rejoin_mesh(autopar.Async(), [4], rank=1),
        OptionError,
        "rejoin_mesh(sizes=...) must be",
    ),
    (
        lambda: autopar.worker_mesh(autopar.Async(), {"dp": 4}),
        OptionError,
        "there is none: call torch.distributed.init_process_group(...) on every rank first",
    ),
    (lambda: autopar.worker_mesh(autopar.Async(), {"dp": 4}, 3), OptionError, "worker_mesh(device_type=...)"),
    (
        lambda: autopar.plan(*_gpt(6), {"dp": 4}, update=autopar.Async()),
        ShapeError,
        "under an update mode every input's dim 0 is the batch, cut among 4 units: example_args[0] has "
        "shape (6, 32); give a batch that 4 units share equally, at least one sample each",
    ),
    (lambda: autopar.plan(*_gpt(0), {"dp": 4}, update=autopar.Async()), ShapeError, "has shape (0, 32)"),
    (
        lambda: autopar.plan(*_gpt(6), {"dp": 4}, update=autopar.Hybrid(groups=4)),
        ShapeError,
        "cut among 4 units",
    ),
    (lambda: ServerRank(0, None, [0]).serve(resume=3), OptionError, "serve(resume=...) must be a checkpoint"),
    (
        lambda: ServerRank(0, None, [0]).serve(resume="/missing/run"),
        CheckpointError,
        "serve(resume='/missing/run'): it holds no server-0.pt; give the folder dmodel.save_checkpoint",
    ),
]


def _gpt(batch: int) -> tuple[nn.Module, tuple]:
    from examples import gpt

    model, (idx, _) = gpt.build(batch_size=batch, device="meta")
    return model, (idx,)


@pytest.mark.parametrize(("make", "kind", "message"), UPDATES, ids=[str(i) for i in range(len(UPDATES))])
def test_update_modes_and_their_meshes_check_what_they_are_given(make, kind, message):
    with pytest.raises(kind, match=re.escape(message)):
        make()


_TIMEOUT = 2.0


def _timed(call, *args: object, **kwargs: object) -> tuple[str, str, float]:
    start = time.perf_counter()
    try:
        call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the class is returned and asserted
        return type(e).__name__, str(e), time.perf_counter() - start
    return "", "", time.perf_counter() - start


def _step(meter: StepMeter) -> None:
    with meter.step():
        pass


def _apart() -> dict[str, tuple[str, str, float]]:
    """On 2 gloo ranks: steps together, then each rank alone in a step, then rank 0 alone making a meter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    torch.manual_seed(0)
    model, args = build()
    dmodel = autopar.compile(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), args)
    out = {"file": _timed(StepMeter, dmodel, jsonl="/missing/dir/x.jsonl", timeout_s=_TIMEOUT)}
    meter = StepMeter(dmodel, tokens=8, echo=False, timeout_s=_TIMEOUT)
    out["together"] = _timed(_step, meter)
    for alone in (0, 1):  # the other rank moved on to a plain collective, then calls step() late
        meter = StepMeter(dmodel, echo=False, timeout_s=_TIMEOUT)
        if rank == alone:
            out[f"alone {alone}"] = _timed(_step, meter)
            dist.barrier()
        else:
            dist.barrier()
            out[f"late {alone}"] = _timed(_step, meter)
    out["again"] = _timed(_step, meter)
    if rank == 0:
        out["made alone"] = _timed(StepMeter, dmodel, timeout_s=_TIMEOUT)
    dist.barrier()
    return out


@pytest.mark.distributed
def test_a_step_on_some_ranks_only_fails_within_seconds_on_every_rank():
    zero, one = spawn(_apart, 2)
    for rank in (zero, one):  # the first rank's verdict on the file, on every rank
        assert rank["file"][:2] == (
            "OptionError",
            "StepMeter(jsonl='/missing/dir/x.jsonl') cannot be appended to (No such file or directory): "
            "there is no folder /missing/dir",
        )
        assert rank["together"][0] == ""
    mismatch = "CollectiveMismatchError"
    # the first rank watches the others and names the rank missing
    assert zero["alone 0"][:2] == (
        mismatch,
        "StepMeter.step(): rank 1 did not enter step 0 within 2 s; every rank must call step() at every step",
    )
    assert one["alone 1"][:2] == (
        mismatch,
        "StepMeter.step(): not every rank entered step 0 within 2 s; every rank must call step() at "
        "every step",
    )
    for rank, alone, late in ((zero, "alone 0", "late 1"), (one, "alone 1", "late 0")):
        assert _TIMEOUT - 0.5 < rank[alone][2] < _TIMEOUT + 3
        assert rank[late][0] == mismatch and "step 0 within 2 s" in rank[late][1] and rank[late][2] < 3
        assert rank["again"][0] == mismatch and "after an earlier failure" in rank["again"][1]
    assert zero["made alone"][0] == mismatch and zero["made alone"][2] < _TIMEOUT + 3
    assert "StepMeter(): not every rank constructed the meter within 2 s" in zero["made alone"][1]
    assert issubclass(CollectiveMismatchError, autopar.AutoparError)
