"""Mixed precision (``autopar.MixedPrecision``): compute in bf16/fp16, fp32 master weights.

The plan's program casts every parameter where it is read and the floating inputs to the
compute dtype, and the floating outputs to fp32; the cost and memory models price what the
graph holds (fp32 parameters, gradients and optimizer state, activations in the compute
dtype). On 4 gloo ranks, losses and every gradient equal one device running the same casts
by hand (``torch.func.functional_call`` with the parameters cast), for the example GPT and a
transformers Llama, with ZeRO-1/2/3, recompute, optimizer offload and a pipeline.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call

import autopar
from autopar import OptionError, PlanError
from autopar.tools.fake_ranks import fake_world
from autopar.tools.launch import spawn
from examples import gpt
from tests import zoo_models

BF16 = autopar.MixedPrecision()
BF = torch.bfloat16


def _llama() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model, _, kwargs = zoo_models.build("llama")
    return model, kwargs


def test_the_program_casts_parameters_inputs_and_outputs():
    model, args = gpt.build()
    plan = autopar.plan(model, args, {"dp": 2, "tp": 2}, precision=BF16)
    assert plan.precision == {"param_dtype": "bfloat16", "output_dtype": "float32", "reduce_dtype": None}
    assert "aten._to_copy(p_lm_head_weight, dtype=torch.bfloat16)" in plan.code
    assert "aten._to_copy(p_blocks_0_mlp_fc_weight, dtype=torch.bfloat16)" in plan.code
    assert "aten.to.dtype(div, torch.float32)" in plan.code  # the loss, cast back
    assert autopar.Plan.from_dict(plan.to_dict()).precision == plan.precision
    assert "precision: compute in bfloat16" in plan.summary(100)


def test_the_cost_and_memory_models_price_fp32_state_and_bf16_compute():
    model, args = gpt.build(batch_size=128)
    # one device: the same layouts, so only the dtypes differ
    full = autopar.plan(model, args, {"dp": 1}).prediction
    mixed = autopar.plan(model, args, {"dp": 1}, precision=BF16).prediction
    assert mixed.param_bytes == full.param_bytes and mixed.grad_bytes == full.grad_bytes
    assert mixed.optimizer_bytes == full.optimizer_bytes
    # activations in bf16 (each layer's bf16 copy of its weights is kept for backward too)
    assert 0.4 * full.activation_bytes < mixed.activation_bytes < 0.55 * full.activation_bytes
    assert mixed.compute_s < full.compute_s / 2  # the cpu-gloo preset's bf16 peak is 6x its fp32 one


def test_gradient_sums_are_priced_in_the_reduce_dtype():
    from autopar.ir.mesh import MeshSpec
    from autopar.planning.cost.model import CostModel, get_cluster
    from autopar.planning.graph.strategy_graph import build_strategy_graph
    from autopar.planning.planner import capture_for

    model, args = gpt.build()
    mesh = MeshSpec.of({"dp": 2})
    for precision, itemsize in ((BF16, 4), (autopar.MixedPrecision(reduce_dtype=torch.bfloat16), 2)):
        captured = capture_for(model, args, None, mesh, None, precision)
        g = build_strategy_graph(captured, mesh, CostModel(mesh, get_cluster("cpu-gloo")))
        params = [n for n in captured.graph.nodes if n.name in captured.params]
        assert {g.grad_sum_itemsize(n) for n in params} == {itemsize}
        assert autopar.MixedPrecision.from_dict(precision.to_dict()) == precision


def test_a_transformers_llama_traces_in_bf16():
    model, kwargs = _llama()
    plan = autopar.plan(model, (), {"dp": 2, "tp": 2}, example_kwargs=kwargs, precision=BF16)
    # Llama's RMSNorm computes in fp32 and casts back to its input's dtype: bf16 under the policy
    assert "dtype=torch.float32" in plan.code and "dtype=torch.bfloat16" in plan.code
    assert not [w for w in plan.warnings if not w.startswith("the plan splits no tensor")]


def test_bad_precision_options_are_refused():
    model, args = gpt.build()
    with pytest.raises(OptionError, match="precision must be autopar.MixedPrecision"):
        autopar.plan(model, args, {"dp": 2}, precision="bf16")
    with pytest.raises(OptionError, match=r"MixedPrecision\(param_dtype=...\) is one of torch.float32"):
        autopar.MixedPrecision(param_dtype=torch.int8)
    plain = autopar.plan(model, args, {"dp": 2})
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(PlanError, match="the plan was made for precision as built"):
            autopar.compile(model, mesh, args, plan=plain, precision=BF16)


def _reference(model: torch.nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> torch.Tensor:
    """One device, the same casts by hand: parameters and floating inputs to ``dtype``, loss to fp32."""

    def cast(t: object) -> object:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    params = {n: p.to(dtype) for n, p in model.named_parameters()}
    inputs = tuple(cast(a) for a in args)
    out = functional_call(model, params, inputs, {k: cast(v) for k, v in kwargs.items()})
    loss = (out if isinstance(out, torch.Tensor) else out.loss).float()
    loss.backward()
    return loss.detach()


CASES = {
    "gpt dp2 x tp2": ("gpt", (2, 2), ("dp", "tp"), {}, torch.bfloat16),
    "gpt dp4 ZeRO-3 recompute": ("gpt", (4,), ("dp",), {"memory": autopar.Memory(zero=3)}, torch.bfloat16),
    "llama dp2 x tp2 ZeRO-2": ("llama", (2, 2), ("dp", "tp"), {"memory": autopar.Memory(zero=2)}, BF),
    "gpt fp16 ZeRO-1 offload": (
        "gpt",
        (4,),
        ("dp",),
        {"memory": autopar.Memory(zero=1, offload_optimizer=True)},
        torch.float16,
    ),
    "gpt pp2 x dp2": ("gpt", (2, 2), ("pp", "dp"), {"pipeline": autopar.Pipeline(2)}, torch.bfloat16),
    "gpt dp4 ZeRO-2, sums in bf16": ("gpt", (4,), ("dp",), {"memory": autopar.Memory(zero=2)}, BF),
}


def _world(names: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    for name in names:
        kind, shape, axes, options, dtype = CASES[name]
        torch.manual_seed(0)  # the same model on every rank
        if kind == "gpt":
            model, args = gpt.build(**({"batch_size": 8} if "sums" in name else {}))
            kwargs: dict = {}
            if "recompute" in name:
                autopar.recompute(model.blocks[0])
            if "sums" in name:  # data parallel, weights used whole: the reducer sums them, in bf16
                autopar.shard(model, in_strategy=((4, 1), (4, 1)))
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear):
                        autopar.shard(module, parameter_plan={"weight": (1, 1)})
        else:
            model, kwargs = _llama()
            args = ()
        reference = copy.deepcopy(model)
        want = _reference(reference, args, kwargs, dtype)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
        precision = autopar.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype if "sums" in name else None)
        dmodel = autopar.compile(
            model, mesh, args, example_kwargs=kwargs or None, precision=precision, **options
        )
        optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-3)
        loss = dmodel.train_step(kwargs or args)
        worst, dtypes = 0.0, set()
        for fqn, p in dmodel.named_parameters():
            grad, ref = p.grad.full_tensor(), reference.get_parameter(fqn).grad
            worst = max(worst, ((grad - ref).abs().max() / max(ref.abs().max().item(), 1e-2)).item())
            dtypes |= {p.dtype, grad.dtype}
        optimizer.step()
        results[name] = (loss.item(), want.item(), loss.dtype, worst, dtypes)
    return results


SCALER = {"init_scale": 2.0**17, "growth_interval": 2}  # overflows twice, steps, grows, overflows
SCALED_STEPS = 7


def _scaled_reference(microbatches: int) -> tuple[list[float], list[float]]:
    """One device, fp16 casts by hand, ``torch.amp.GradScaler``: the losses and the scale before each
    step. Each of ``microbatches`` losses is scaled by ``1/microbatches`` too (a pipeline's mean), so
    the same overflows come at a scale that many times larger."""
    torch.manual_seed(0)
    model, args = gpt.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", **{**SCALER, "init_scale": SCALER["init_scale"] / microbatches})
    losses, scales = [], []
    for _ in range(SCALED_STEPS):
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
        params = {n: p.half() for n, p in model.named_parameters()}
        loss = functional_call(model, params, tuple(a.half() if a.is_floating_point() else a for a in args))
        scaler.scale(loss.float()).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.float().item())
    return losses, [s * microbatches for s in scales]


def _scaled_world() -> dict[str, tuple[list[float], list[float], int]]:
    """fp16 with ``autopar.LossScaler`` on 4 ranks: a pipeline through ``train_step``, and ZeRO-1 with
    the optimizer offloaded through the user's own ``scaler.scale(loss).backward()``."""
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    setups = {"pp2 x dp2": ((2, 2), ("pp", "dp")), "dp2 x tp2 ZeRO-1 offload": ((2, 2), ("dp", "tp"))}
    for name, (shape, axes) in setups.items():
        torch.manual_seed(0)
        model, args = gpt.build()
        options = (
            {"pipeline": autopar.Pipeline(2)}
            if "pp" in axes
            else {"memory": autopar.Memory(zero=1, offload_optimizer=True)}
        )
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
        precision = autopar.MixedPrecision(torch.float16)
        dmodel = autopar.compile(model, mesh, args, precision=precision, **options)
        optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-3)
        scaler = autopar.LossScaler(**SCALER)
        losses, scales = [], []
        for _ in range(SCALED_STEPS):
            optimizer.zero_grad()
            scales.append(scaler.scale_value)
            if "pp" in axes:
                loss = dmodel.train_step(args, loss_scaler=scaler)
            else:
                loss = dmodel(*dmodel.shard_inputs(*args)[0])
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        results[name] = (losses, scales, scaler.skipped_steps)
    return results


def _all_worlds(names: list[str]) -> tuple[dict, dict]:
    return _world(names), _scaled_world()


@pytest.mark.distributed
def test_mixed_precision_trains_on_4_gloo_ranks_as_on_one_device_with_the_same_casts():
    outcomes = spawn(_all_worlds, 4, list(CASES))
    results, scaled = outcomes[0]
    # every rank took the same steps and skipped the same: the overflow check is the world's
    assert all(o[1] == scaled for o in outcomes)
    for name, (losses, scales, skipped) in scaled.items():
        want_losses, want_scales = _scaled_reference(2 if "pp" in name else 1)
        assert scales == want_scales and skipped == 3, name
        assert losses == pytest.approx(want_losses, rel=1e-3), name
    for name, (loss, want, dtype, worst, dtypes) in results.items():
        assert loss == pytest.approx(want, rel=1e-3), name
        assert dtype == torch.float32 and dtypes == {torch.float32}, name  # fp32 masters and gradients
        # bf16 sums in another order (Megatron's partial sums, sharded batches): within 2% of the largest
        assert worst < 0.02, (name, worst)


def test_a_saved_plan_brings_its_precision_to_compile():
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, args = gpt.build()
    saved = autopar.Plan.from_dict(autopar.plan(model, args, {"dp": 2}, precision=BF16).to_dict())
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        dmodel = autopar.compile(model, mesh, args, plan=saved)
        assert dmodel.plan.precision == saved.precision
        assert "dtype=torch.bfloat16" in dmodel.code
        with pytest.raises(PlanError, match="the plan computes with MixedPrecision"):
            autopar.compile(model, mesh, args, plan=saved, precision=autopar.MixedPrecision(torch.float16))


def test_gradients_reduced_in_the_compute_dtype_are_named():
    """A parameter stored split and gathered in bf16 has its gradient reduce-scattered in bf16:
    the plan says so unless reduce_dtype is bf16 anyway."""
    model, kwargs = _llama()
    ids = torch.randint(0, zoo_models.VOCAB, (16, 64))  # enough to split the batch over dp
    kwargs = {**kwargs, "input_ids": ids, "labels": ids}

    def warned(precision: autopar.MixedPrecision) -> list[str]:
        plan = autopar.plan(
            model, (), {"dp": 2}, example_kwargs=kwargs, precision=precision, cluster="fast-links"
        )
        return [w for w in plan.warnings if "stored split are gathered for use in bfloat16" in w]

    (warning,) = warned(BF16)
    assert "not in their own dtype (reduce_dtype)" in warning
    assert not warned(autopar.MixedPrecision(reduce_dtype=torch.bfloat16))


def test_the_loss_scaler_skips_overflowing_steps_backs_off_and_grows():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scaler = autopar.LossScaler(init_scale=8.0, growth_interval=2)
    for grad, stepped, scale in (((1.0, float("inf"), 0.0), False, 4.0), ((8.0, 8.0, 8.0), True, 4.0)):
        weight.grad = torch.tensor(grad) * scaler.scale_value / 8
        assert scaler.step(optimizer) is stepped
        scaler.update()
        assert scaler.scale_value == scale
    assert weight.tolist() == [0.5, 0.5, 0.5]  # the skipped step left it alone; the other saw grad 1
    weight.grad = torch.ones(3) * scaler.scale_value
    assert not scaler.unscale_(optimizer) and weight.grad.tolist() == [1.0, 1.0, 1.0]
    assert not scaler.unscale_(optimizer) and weight.grad.tolist() == [1.0, 1.0, 1.0]  # once a step
    scaler.step(optimizer)
    scaler.update()
    assert scaler.state_dict() == {"scale": 8.0, "good_steps": 0, "skipped_steps": 1}
    restored = autopar.LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    with pytest.raises(OptionError, match="update\\(\\) before step\\(\\)"):
        restored.update()
    with pytest.raises(OptionError, match="backoff_factor=...\\) must be a number above 0 and below 1"):
        autopar.LossScaler(backoff_factor=2.0)
    with pytest.raises(OptionError, match="growth_interval=...\\) must be an int >= 1"):
        autopar.LossScaler(growth_interval=0)
