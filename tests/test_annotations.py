"""Tests of autopar.capture.annotations: strategy lowering, recording, validation and capture hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autopar.capture.annotations import (
    ShardAnnotation,
    collect_annotations,
    pipeline_stage,
    recompute,
    shard,
    shard_annotation,
)
from autopar.capture.constraint_op import constraint_spec, parse_constraint_spec
from autopar.capture.hooks import annotation_hooks, constrain
from autopar.capture.strategies import lower_strategy
from autopar.ir.errors import AnnotationError
from autopar.ir.mesh import MeshSpec

R = Replicate()
DP_TP = MeshSpec.of({"dp": 2, "tp": 4})
SQUARE = MeshSpec.of({"dp": 2, "tp": 2})
CONSTRAINT = torch.ops.autopar.layout_constraint.default


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = constrain(torch.relu(self.fc(x)), (None, "tp"))
        return self.proj(h) + y, h


class Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.mlp(x, x * 2)
        return self.head(out)


def lower(strategy, shape=(8, 8), mesh=DP_TP):
    return lower_strategy(strategy, shape, mesh, where="W")


def constraint_specs(ep: torch.export.ExportedProgram) -> list[tuple[tuple, str]]:
    return [parse_constraint_spec(n.args[1]) for n in ep.graph.nodes if n.target is CONSTRAINT]


def export(model: nn.Module, *args: torch.Tensor, mesh=DP_TP) -> torch.export.ExportedProgram:
    with annotation_hooks(model, mesh):
        return torch.export.export(model, args, strict=False)


# --------------------------------------------------------------------------- lowering


@pytest.mark.parametrize(
    ("strategy", "layout"),
    [
        (("dp", None), (Shard(0), R)),
        ((None, "tp"), (R, Shard(1))),
        (("tp", "dp"), (Shard(1), Shard(0))),
        ((("dp", "tp"), None), (Shard(0), Shard(0))),
        ((None, None), (R, R)),
    ],
)
def test_named_form(strategy, layout):
    assert lower(strategy) == layout


@pytest.mark.parametrize(
    ("strategy", "layout"),
    [
        ((1, 1), (R, R)),
        ((2, 1), (Shard(0), R)),
        ((1, 4), (R, Shard(1))),
        ((2, 4), (Shard(0), Shard(1))),
        ((8, 1), (Shard(0), Shard(0))),
    ],
)
def test_integer_form(strategy, layout):
    assert lower(strategy) == layout


def test_integer_form_ignores_size_one_axes():
    mesh = MeshSpec.of({"dp": 2, "pp": 1, "tp": 2})
    assert lower((4, 1), mesh=mesh) == (Shard(0), R, Shard(0))


def test_zero_dim_tensor():
    assert lower((), shape=()) == (R, R)


def test_integer_form_ambiguous():
    with pytest.raises(AnnotationError, match="ambiguous") as e:
        lower((2, 1), mesh=SQUARE)
    assert "('dp', None)" in str(e.value) and "('tp', None)" in str(e.value)
    assert "named form" in str(e.value)


def test_integer_form_not_expressible():
    mesh = MeshSpec.of({"a": 2, "b": 3, "c": 2})
    with pytest.raises(
        AnnotationError, match=r"count 4 on dim 0 is not expressible on mesh axes a=2, b=3, c=2"
    ):
        lower((4, 1), shape=(8, 8), mesh=mesh)


def test_integer_form_no_disjoint_axes():
    mesh = MeshSpec.of({"a": 2, "b": 4, "c": 2})
    with pytest.raises(AnnotationError, match="disjoint") as e:
        lower((4, 4), mesh=mesh)
    assert "dim 0 (count 4)" in str(e.value) and "dim 1 (count 4)" in str(e.value)


@pytest.mark.parametrize(
    ("strategy", "shape", "words"),
    [
        ((2, 1, 1), (8, 8), ["3 items", "2 dims"]),
        (("dp",), (8, 8), ["1 items", "2 dims"]),
        ((4, 1), (6, 8), ["dim 0", "size 6", "4 equal parts"]),
        ((None, ("dp", "tp")), (8, 12), ["dim 1", "size 12", "8 equal parts", "dp=2, tp=4"]),
        ((0, 1), (8, 8), ["dim 0", "at least 1"]),
        ((2.0, 1), (8, 8), ["dim 0", "2.0"]),
        ((True, 1), (8, 8), ["dim 0", "True"]),
        (("sp", None), (8, 8), ["dim 0", "'sp'", "['dp', 'tp']"]),
        (("tp", "tp"), (8, 8), ["'tp'", "dim 0 and dim 1"]),
        ((("tp", "tp"), None), (8, 8), ["'tp'", "dim 0 and dim 0"]),
        ((("tp", "dp"), None), (8, 8), ["dim 0", "mesh order", "('dp', 'tp')"]),
        (((), None), (8, 8), ["dim 0", "non-empty"]),
        ((2, None), (8, 8), ["mixes"]),
        ((2, "tp"), (8, 8), ["mixes"]),
        ((3, 1), (9, 8), ["multiply to 3", "8 devices"]),
        ([2, 1], (8, 8), ["must be a tuple"]),
    ],
)
def test_lowering_errors(strategy, shape, words):
    with pytest.raises(AnnotationError) as e:
        lower(strategy, shape=shape)
    message = str(e.value)
    assert message.startswith("W: ")
    for word in words:
        assert word in message


# --------------------------------------------------------------------------- recording


def test_shard_instance_records_hashable_annotation():
    mlp = MLP()
    plan = {"fc.weight": ("tp", None)}
    assert shard(mlp, in_strategy=(("dp", None), None), parameter_plan=plan) is mlp
    annotation = shard_annotation(mlp)
    assert annotation == ShardAnnotation(
        in_strategy=(("dp", None), None), parameter_plan=(("fc.weight", ("tp", None)),)
    )
    hash(annotation)
    assert plan == {"fc.weight": ("tp", None)}  # the user's dict is left as it was
    assert shard_annotation(MLP()) is None


def test_shard_class_and_instance_override():
    @shard(in_strategy=(("dp", None),))
    class Block(nn.Linear):
        pass

    assert shard(Block, out_strategy=((2, 1),)) is Block  # a later call replaces the class annotation
    a, b = Block(8, 8), Block(8, 8)
    shard(b, in_strategy=((None, "tp"),))
    assert shard_annotation(a) == ShardAnnotation(out_strategy=((2, 1),))
    assert shard_annotation(b) == ShardAnnotation(in_strategy=((None, "tp"),))
    assert shard_annotation(nn.Linear(8, 8)) is None


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"in_strategy": (2, 1)}, ["in_strategy entry 0", "in_strategy=((2, 1),)"]),
        ({"in_strategy": [(2, 1)]}, ["in_strategy must be a tuple"]),
        ({"out_strategy": ((2, "tp"),)}, ["out_strategy entry 0", "mixes"]),
        ({"parameter_plan": [("weight", (2, 1))]}, ["parameter_plan must be a mapping"]),
        ({"parameter_plan": {"weight": (0, 1)}}, ["parameter_plan['weight']", "dim 0", "at least 1"]),
        ({}, ["at least one of"]),
    ],
)
def test_shard_call_errors(kwargs, words):
    with pytest.raises(AnnotationError) as e:
        shard(nn.Linear(8, 8), **kwargs)
    assert "shard() on Linear" in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_shard_rejects_non_modules():
    with pytest.raises(AnnotationError, match="nn.Module"):
        shard(lambda x: x, in_strategy=((2, 1),))
    with pytest.raises(AnnotationError, match="nn.Module"):
        shard(in_strategy=((2, 1),))(int)


def test_pipeline_stage_and_recompute_record():
    model = Top()
    assert pipeline_stage(model.mlp, 0) is model.mlp
    pipeline_stage(model.head, 1)
    assert recompute(model.mlp) is model.mlp
    recompute(model.mlp)  # a second call changes nothing
    annotations = collect_annotations(model, DP_TP)
    assert dict(annotations.stages) == {"mlp": 0, "head": 1}
    assert dict(annotations.recompute) == {"mlp": "full"}


def test_a_module_is_in_one_stage():
    model = Top()
    pipeline_stage(model.mlp, 0)
    pipeline_stage(model.mlp, 0)  # the same stage again changes nothing
    with pytest.raises(AnnotationError, match=r"already in stage 0, so it cannot be in stage 1"):
        pipeline_stage(model.mlp, 1)


@pytest.mark.parametrize("k", [-1, 1.0, True, "0"])
def test_pipeline_stage_rejects_bad_numbers(k):
    with pytest.raises(AnnotationError, match="non-negative int"):
        pipeline_stage(nn.Linear(2, 2), k)


# --------------------------------------------------------------------------- model-wide validation


def test_parameter_layouts_keyed_by_fqn():
    model = Top()
    shard(model.mlp, parameter_plan={"fc.weight": ("tp", None), "proj.weight": (1, 4), "fc.bias": None})
    shard(model, parameter_plan={"head.weight": (None, "dp")})
    layouts = collect_annotations(model, DP_TP).parameter_layouts
    assert dict(layouts) == {
        "mlp.fc.weight": (R, Shard(0)),
        "mlp.proj.weight": (R, Shard(1)),
        "head.weight": (Shard(1), R),
    }


@pytest.mark.parametrize(
    ("plan", "words"),
    [
        ({"fc.wieght": (2, 1)}, ["module 'mlp' (MLP)", "'fc.wieght'", "'fc.weight'", "'proj.bias'"]),
        ({"fc.weight": (2, 1, 1)}, ["module 'mlp' (MLP) parameter 'fc.weight'", "3 items", "2 dims"]),
        ({"fc.bias": (32,)}, ["module 'mlp' (MLP) parameter 'fc.bias'", "multiply to 32"]),
        ({"fc.weight": (None, ("dp", "tp"))}, ["parameter 'fc.weight'", "dim 1", "size 8", "16 equal"]),
        ({"fc.weight": (3, 1)}, ["parameter 'fc.weight'", "multiply to 3", "16 devices"]),
    ],
)
def test_parameter_plan_errors(plan, words):
    model = Top()
    shard(model.mlp, parameter_plan=plan)
    with pytest.raises(AnnotationError) as e:
        collect_annotations(model, MeshSpec.of({"dp": 2, "tp": 8}))
    for word in words:
        assert word in str(e.value)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.unembed = nn.Linear(8, 16, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.unembed(self.embed(ids))


def test_tied_parameters_share_one_layout():
    model = Tied()
    shard(model.embed, parameter_plan={"weight": ("tp", None)})
    shard(model.unembed, parameter_plan={"weight": ("tp", None)})
    assert dict(collect_annotations(model, DP_TP).parameter_layouts) == {"embed.weight": (R, Shard(0))}
    shard(model.unembed, parameter_plan={"weight": (None, "tp")})
    with pytest.raises(AnnotationError, match="tied") as e:
        collect_annotations(model, DP_TP)
    assert "module 'embed'" in str(e.value) and "module 'unembed'" in str(e.value)


def test_in_out_strategies_checked_against_mesh_at_collection():
    model = Top()
    shard(model.mlp, in_strategy=(("sp", None), None))
    with pytest.raises(AnnotationError, match=r"module 'mlp' \(MLP\) input 0: dim 0: unknown mesh axis 'sp'"):
        collect_annotations(model, DP_TP)


def test_root_module_named_in_messages():
    model = Top()
    shard(model, parameter_plan={"nope": (2, 1)})
    with pytest.raises(AnnotationError, match=r"the root module \(Top\)"):
        collect_annotations(model, DP_TP)


def test_stage_numbers_must_be_contiguous():
    model = Top()
    pipeline_stage(model.mlp, 0)
    pipeline_stage(model.head, 2)
    with pytest.raises(AnnotationError, match=r"missing \[1\]"):
        collect_annotations(model, DP_TP)


def test_nested_stages_must_agree():
    model = Top()
    pipeline_stage(model.mlp, 0)
    pipeline_stage(model.mlp.fc, 0)  # the same stage nested is redundant but fine
    pipeline_stage(model.head, 1)
    collect_annotations(model, DP_TP)
    pipeline_stage(model.mlp.proj, 1)
    with pytest.raises(AnnotationError) as e:
        collect_annotations(model, DP_TP)
    assert "module 'mlp.proj' (Linear) is in stage 1" in str(e.value)
    assert "module 'mlp' (MLP) in stage 0" in str(e.value)


def test_recompute_at_most_once_along_a_hierarchy():
    model = Top()
    recompute(model.mlp.fc)
    recompute(model.head)
    collect_annotations(model, DP_TP)
    recompute(model)
    with pytest.raises(AnnotationError, match="at most once") as e:
        collect_annotations(model, DP_TP)
    assert "the root module (Top)" in str(e.value) and "module 'mlp.fc' (Linear)" in str(e.value)


# --------------------------------------------------------------------------- capture


def test_export_keeps_constraints_with_specs():
    model = Top()
    shard(model.mlp, in_strategy=(("dp", None), None), out_strategy=((2, 4), None))
    ep = export(model, torch.randn(4, 8))
    specs = constraint_specs(ep)
    assert len(specs) == 3
    assert specs[0] == ((Shard(0), R), "module 'mlp' (MLP) input 0 (x)")
    layout, origin = specs[1]
    assert layout == (R, Shard(1))
    assert origin.startswith("constrain() in module 'mlp' (MLP) at test_annotations.py:")
    assert specs[2] == ((Shard(0), Shard(1)), "module 'mlp' (MLP) output 0")
    # The op is opaque to decompositions, so the constraints reach the planner.
    assert len(constraint_specs(ep.run_decompositions())) == 3


def test_export_on_meta_device():
    with torch.device("meta"):
        model = Top()
    shard(model.mlp, in_strategy=(None, (4, 1)), out_strategy=(None, ("dp", "tp")))
    ep = export(model, torch.randn(4, 8, device="meta"))
    assert [origin.split(" at ")[0] for _, origin in constraint_specs(ep)] == [
        "module 'mlp' (MLP) input 1 (y)",
        "constrain() in module 'mlp' (MLP)",
        "module 'mlp' (MLP) output 1",
    ]


def test_spec_json_format():
    spec = constraint_spec((Shard(0), R), "module 'mlp' (MLP) input 0 (x)")
    assert spec == '{"layout": "S(0)R", "origin": "module \'mlp\' (MLP) input 0 (x)"}'
    assert parse_constraint_spec(spec) == ((Shard(0), R), "module 'mlp' (MLP) input 0 (x)")
    with pytest.raises(AnnotationError, match="not a layout_constraint spec"):
        parse_constraint_spec('{"layout": "S(0)R"}')


class Varied(nn.Module):
    """Tensor and non-tensor inputs, ``*args``, ``**kwargs`` and a dict output."""

    def forward(self, x, scale, *rest, **extra):
        return {"sum": x * scale + sum(rest) + sum(extra.values()), "note": "ok", "x": x}


def test_inputs_bound_to_signature_and_outputs_flattened():
    model = Varied()
    shard(model, in_strategy=((2, 1), (None, "tp"), (1, 4)), out_strategy=(None, ("dp", None)))
    x = torch.randn(4, 8)
    with annotation_hooks(model, DP_TP):
        ep = torch.export.export(model, (x, 2.0, x), {"bias": x}, strict=False)
        eager = model(x, 2.0, x, bias=x)
    assert [origin for _, origin in constraint_specs(ep)] == [
        "the root module (Varied) input 0 (x)",
        "the root module (Varied) input 1 (rest[0])",
        "the root module (Varied) input 2 (bias)",
        "the root module (Varied) output 1",
    ]
    torch.testing.assert_close(eager["sum"], x * 2.0 + x + x)
    assert eager["note"] == "ok"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"in_strategy": ((2, 1),)},
            ["module 'mlp' (MLP)", "len(in_strategy) is 1", "2 tensor inputs (x, y)"],
        ),
        ({"out_strategy": ((2, 8),)}, ["module 'mlp' (MLP)", "len(out_strategy) is 1", "2 tensor outputs"]),
        ({"in_strategy": (None, (2, 1, 1))}, ["module 'mlp' (MLP) input 1 (y)", "3 items", "2 dims"]),
        ({"in_strategy": ((None, ("dp", "tp")), None)}, ["input 0 (x)", "dim 1", "size 8"]),
        ({"out_strategy": (None, (8, 1))}, ["module 'mlp' (MLP) output 1", "dim 0", "size 4"]),
    ],
)
def test_capture_time_errors(kwargs, words):
    model = Top()
    shard(model.mlp, **kwargs)
    with pytest.raises(AnnotationError) as e:
        export(model, torch.randn(4, 8), mesh=MeshSpec.of({"dp": 2, "tp": 8}))
    for word in words:
        assert word in str(e.value)


def test_constrain_errors_name_module_or_call_site():
    class Bad(nn.Module):
        def forward(self, x):
            return constrain(x, (2, 1, 1))

    model = nn.Sequential(Bad())
    with pytest.raises(
        AnnotationError, match=r"constrain\(\) in module '0' \(Bad\) at test_annotations.py:\d+"
    ):
        export(model, torch.randn(4, 8))
    with annotation_hooks(model, DP_TP):
        with pytest.raises(AnnotationError, match=r"^constrain\(\) at test_annotations.py:\d+: .*3 items"):
            constrain(torch.randn(4, 8), (2, 1, 1))
        with pytest.raises(AnnotationError, match="expected a tensor"):
            constrain([1, 2], (2,))


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_hooks_removed_and_constrain_disabled_after_capture():
    model = Top()
    shard(model.mlp, in_strategy=((2, 1), None), out_strategy=(None, None))
    with annotation_hooks(model, DP_TP):
        assert hook_count(model) > 0
        with pytest.raises(AnnotationError, match="already active"):
            with annotation_hooks(model, DP_TP):
                pass
    assert hook_count(model) == 0
    x = torch.randn(4, 8)
    assert constrain(x, (2, 1)) is x


def test_hooks_removed_after_an_error():
    model = Top()
    shard(model.mlp, in_strategy=(None, (3, 1)))
    with pytest.raises(AnnotationError):
        export(model, torch.randn(4, 8), mesh=MeshSpec.of({"dp": 3}))
    assert hook_count(model) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with annotation_hooks(model, {"dp": 3}):
            raise RuntimeError("boom")
    assert hook_count(model) == 0
    x = torch.randn(3, 8)
    assert constrain(x, (3, 1)) is x


def test_constrain_outside_capture_is_the_identity():
    x = torch.randn(4, 8)
    assert constrain(x, ("dp", None)) is x
    assert constrain(x, "not even a strategy") is x  # not inspected at all outside a capture


def test_layout_constraint_eager_copy_and_identity_gradient():
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.ops.autopar.layout_constraint(x, constraint_spec((Shard(0), R), "test"))
    assert y is not x
    torch.testing.assert_close(y, x)
    (y * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(8.0).expand(4, 8))


def test_eager_forward_inside_capture_is_unchanged():
    model = Top()
    shard(model.mlp, in_strategy=((2, 1), None), out_strategy=(("dp", "tp"), None))
    x = torch.randn(4, 8)
    expected = model(x)
    with annotation_hooks(model, DP_TP):
        torch.testing.assert_close(model(x), expected)
