"""autopar.compile on torch's fake process group: the program, the module, and bad input.

Nothing here communicates: the fake backend gives a world of ranks without peers,
enough to build meshes, DTensors and the per-rank program.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import autopar
from autopar.passes import place_on_device
from examples import gpt


def _megatron_gpt():
    model, args = gpt.build(batch_size=4)
    return gpt.annotate(model, "dp-tp"), args


@pytest.fixture
def mesh(fake_process_group):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_program_shows_every_collective_and_parameters_are_dtensors(mesh):
    model, args = _megatron_gpt()
    dmodel = autopar.compile(model, mesh, args, cluster="fast-links")
    code = dmodel.code
    assert code.startswith("# Constructed by autopar.compile on mesh dp=2×tp=2\ndef forward(")
    # row-parallel linear: partial sums all-reduced in forward, identity in backward ("g") ...
    assert (
        "linear_5 = aten.linear(gelu, p_blocks_0_mlp_proj_weight, to_partial_default_1)"
        "  # S(0)S(2), RS(1), RP -> S(0)P" in code
    )
    assert "autopar.all_reduce(linear_5, 'tp', 'identity')  # S(0)P -> S(0)R" in code
    # ... no blocking data-parallel sum mid-backward: they all wait for the parameters (bucketed) ...
    assert "autopar.grad_all_reduce(" not in code
    # ... and gathers whose backward reduce-scatters the partial gradients
    assert "autopar.all_gather(layer_norm, 1, 'tp', 'reduce_scatter')  # S(0)S(1) -> S(0)R" in code
    # local sizes: 4 heads split over tp=2, batch 4 over dp=2
    assert "aten.reshape(linear, [2, 32, 2, 16])" in code  # a view where the strides allow one
    assert "layout_constraint" not in code and "redistribute" not in code
    # parameters: DTensors in the planned placements, original names, state_dict keys unchanged
    fc = dmodel.get_parameter("blocks.0.mlp.fc.weight")
    assert isinstance(fc, DTensor) and fc.placements == (Replicate(), Shard(0))
    assert fc.to_local().shape == (128, 64) and fc.shape == (256, 64)
    assert set(dmodel.state_dict()) == set(model.state_dict())
    # data-parallel gradient sums, bucketed: fc's weight over dp; the norms' (replicated on tp
    # too, and fed sharded activations there) over both axes
    axes = {
        id(p): a for bucket, a in zip(dmodel.grad_reducer.buckets, dmodel.grad_reducer.axes) for p in bucket
    }
    assert axes[id(fc)] == ("dp",)
    assert axes[id(dmodel.get_parameter("blocks.0.ln_1.weight"))] == ("dp", "tp")
    assert len(dmodel.grad_reducer.buckets) == 2
    # every pass's graph can be read
    assert list(dmodel.pass_snapshots) == [
        "strip_export_checks",
        "place_on_device",
        "apply_plan",
        "insert_redistributions",
        "lower_collectives",
        "drop_layout_constraints",
        "localize_shapes",
        "localize_lookups",
        "localize_views",
        "verify_layouts",
        "check_local_program",
        "mark_recompute",
        "apply_recompute",
        "split_stages",
    ]
    assert "redistribute(" in dmodel.pass_snapshots["insert_redistributions"]


def test_inputs_of_the_wrong_shape_get_a_clear_error(mesh):
    model, args = _megatron_gpt()
    dmodel = autopar.compile(model, mesh, args)
    local_args, _ = dmodel.shard_inputs(*args)
    assert local_args[0].shape == (2, 32)
    with pytest.raises(autopar.ShapeError, match=r"input 'idx' has shape \(4, 32\).*local piece \(2, 32\)"):
        dmodel(*args)


class _Scaled(torch.nn.Module):
    """A model with non-tensor options, called as users call transformers models."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, return_dict: bool = False) -> object:
        y = self.proj(x) * scale
        return {"out": y} if return_dict else y


def test_non_tensor_inputs_are_constants_of_the_program(mesh):
    x = torch.randn(4, 8)
    dmodel = autopar.compile(_Scaled(), mesh, (x,), example_kwargs={"scale": 2.0, "return_dict": True})
    local_args, local_kwargs = dmodel.shard_inputs(x, scale=2.0, return_dict=True)
    assert local_kwargs == {"scale": 2.0, "return_dict": True}
    assert set(dmodel(*local_args, **local_kwargs)) == {"out"}
    with pytest.raises(
        autopar.ShapeError, match=r"input 'scale' is 3.0, but the module was compiled with scale=2.0"
    ):
        dmodel(*local_args, scale=3.0, return_dict=True)
    with pytest.raises(
        autopar.ShapeError, match=r"input 'return_dict' is 1, .* compiled with return_dict=True"
    ):
        dmodel(*local_args, scale=2.0, return_dict=1)


def test_a_plan_for_another_mesh_or_model_is_refused(mesh):
    model, args = gpt.build(batch_size=4)
    other_mesh = autopar.plan(model, args, {"dp": 4})
    with pytest.raises(autopar.PlanError, match="plan is for mesh dp=4"):
        autopar.compile(model, mesh, args, plan=other_mesh)
    bigger, bigger_args = gpt.build(batch_size=4, n_layers=3)
    other_model = autopar.plan(bigger, bigger_args, {"dp": 2, "tp": 2})
    with pytest.raises(autopar.PlanError, match="another model"):
        autopar.compile(model, mesh, args, plan=other_model)


def test_a_saved_plan_compiles_to_the_same_program(mesh, tmp_path):
    model, args = _megatron_gpt()
    plan = autopar.plan(model, args, {"dp": 2, "tp": 2})
    plan.save(tmp_path / "plan.json")
    from_file = autopar.compile(model, mesh, args, plan=autopar.load_plan(tmp_path / "plan.json"))
    planned_here = autopar.compile(model, mesh, args)
    assert from_file.code == planned_here.code


def test_compile_needs_a_named_device_mesh():
    model, args = gpt.build(batch_size=4)
    with pytest.raises(autopar.CompileError, match="DeviceMesh"):
        autopar.compile(model, {"dp": 2}, args)


def test_a_model_built_on_meta_gets_the_same_initialised_weights_on_every_rank(mesh):
    model, _ = gpt.build(batch_size=4, device="meta")
    args = gpt.build(batch_size=4)[1]
    dmodel = autopar.compile(model, mesh, args)
    for name, p in dmodel.named_parameters():
        local = p.to_local()
        assert local.device.type == "cpu" and torch.isfinite(local).all(), name
    # the documented initializer: reset_parameters() under the seed, whatever the caller's RNG
    torch.manual_seed(123)
    again = autopar.compile(gpt.build(batch_size=4, device="meta")[0], mesh, args)
    fc, fc_again = (m.get_parameter("blocks.0.mlp.fc.weight").to_local() for m in (dmodel, again))
    torch.testing.assert_close(fc, fc_again)
    assert model.get_parameter("blocks.0.mlp.fc.weight").is_meta  # the user's model is untouched


def test_a_key_value_cache_output_is_dropped_and_said(mesh):
    """transformers' causal LMs return a DynamicCache unless called with use_cache=False:
    the compiled module returns None there, and the plan says so."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
    )
    ids = torch.randint(0, 64, (4, 8))
    batch = {"input_ids": ids, "labels": ids}
    dmodel = autopar.compile(transformers.LlamaForCausalLM(config), mesh, (), example_kwargs=batch)
    # transformers 5.24 renamed the output field from past_key_values to cache
    cache_field = "cache" if "cache" in transformers.LlamaForCausalLM(config)(**batch) else "past_key_values"
    assert any(
        w.startswith(f"output['{cache_field}'] (DynamicCache) is not returned") for w in dmodel.plan.warnings
    )
    assert not any("no sharding rule" in w for w in dmodel.plan.warnings)
    local_args, local_kwargs = dmodel.shard_inputs(**batch)
    out = dmodel(*local_args, **local_kwargs)
    assert getattr(out, cache_field) is None and out.loss.shape == ()


def test_without_examples_the_first_call_is_the_example(mesh):
    model, args = gpt.build(batch_size=4)
    plain = gpt.build(batch_size=4)[0]
    plain.load_state_dict(model.state_dict())
    dmodel = autopar.compile(model, mesh)
    # no distributed parameters before the first call: an optimizer cannot take the plain model's
    with pytest.raises(autopar.CompileError, match="compiles on its first call"):
        torch.optim.SGD(dmodel.parameters(), lr=0.1)
    with pytest.raises(autopar.CompileError, match="first call"):
        _ = dmodel.plan
    loss = dmodel(*args)  # the global batch, as the plain model takes it
    assert loss.shape == ()
    assert dmodel.plan.mesh_spec.axis_names == ("dp", "tp")
    assert set(dmodel.state_dict()) == set(plain.state_dict())
    assert all(isinstance(p, DTensor) for p in dmodel.parameters())
    assert "def forward(" in dmodel.code
    longer = tuple(torch.cat([a, a], dim=0) for a in args)
    with pytest.raises(
        autopar.ShapeError, match=r"input .idx. has shape \(8, 32\); compiled for the global shape \(4, 32\)"
    ):
        dmodel(*longer)


class _WithNumber(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        y = self.proj(x)
        return y.sum(), y.pow(2).sum().item()


def test_a_python_number_output_is_taken_from_the_whole_value(mesh):
    model = _WithNumber()
    autopar.shard(model, in_strategy=(("dp", None),))  # split the batch: sums are partial per rank
    dmodel = autopar.compile(model, mesh, (torch.randn(64, 8),), cluster="fast-links")
    number = dmodel.code.split("pow_1")[-1]
    assert "autopar.all_reduce(" in number, dmodel.code  # reduced before it becomes a number
    loss, value = dmodel(*dmodel.shard_inputs(torch.randn(64, 8))[0])
    assert isinstance(value, float) and isinstance(loss, torch.Tensor)


class _TokenTypes(torch.nn.Module):
    """An integer table looked up by position (RoBERTa's token type ids), split along the lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.types = torch.nn.Parameter(torch.arange(16).remainder(3).view(1, 16), requires_grad=False)
        self.emb = torch.nn.Embedding(3, 8)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.emb(self.types.expand(pos.shape[0], 16).gather(1, pos)).sum()


def test_a_lookup_into_a_split_integer_table_keeps_its_dtype(mesh):
    # each rank masks the rows it does not hold with a zero of the table's dtype: a float zero
    # made the looked-up ids float, which the embedding refused
    model = _TokenTypes()
    autopar.shard(model, parameter_plan={"types": (None, "tp")})
    pos = torch.randint(0, 16, (4, 16))
    dmodel = autopar.compile(model, mesh, (pos,))
    assert "aten.gather(" in dmodel.code and ", 0)  # R" in dmodel.code
    assert torch.isfinite(dmodel(*dmodel.shard_inputs(pos)[0]))


def test_tensors_the_program_creates_are_on_the_rank_device():
    """Export records a factory's device as the example inputs had it (``meta`` here, the CPU for
    a model planned there and run on GPUs); ``place_on_device`` creates it on the rank's device."""

    class AddPositions(torch.nn.Module):
        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            # a factory on x's device, and a copy to it (positional in the graph: to.device)
            return x + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype) + ids.to(x.device, x.dtype)

    meta = (torch.zeros(2, 4, device="meta"), torch.zeros(4, dtype=torch.int64, device="meta"))
    gm = torch.export.export(AddPositions(), meta, strict=False).graph_module
    assert "aten.to.device" in gm.code and "device = device(type='meta')" in gm.code
    gm = place_on_device.run(gm, SimpleNamespace(device=torch.device("cpu")))
    gm.recompile()
    assert "type='meta'" not in gm.code
    x, ids = torch.ones(2, 4), torch.arange(4)
    torch.testing.assert_close(gm(x, ids)[0], x + 2 * torch.arange(4.0))
