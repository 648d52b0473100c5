"""The model zoo on 4 real gloo ranks: every architecture trains as on one device.

Each model of ``tests/zoo_models.py`` (dense decoders with GQA, MoE decoders, encoders,
encoder-decoders, vision transformers, CNNs and a hand-written CNN) is compiled on a
dp=2 x tp=2 mesh under the ``fast-links`` cluster model (where splitting pays, so the
solver's plans split batches, heads, channels and sequences and communicate), called
with the keyword options users pass, and trained for two SGD steps next to a copy on one
device. Checked at every step: the loss, every gradient and every buffer (batch norm's
running statistics) equal one device's (``atol=1e-5, rtol=1e-4``), Python numbers the
model returns too, and so they do for a CNN and an encoder with every block recomputed; and
no op of the zoo falls back to replication. For a few models,
``autopar.tools.numerics.first_divergence`` also compares every value of the forward. One model is compiled
without examples (its first call is the example).
"""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.ir.layout import format_layout, parse_layout
from autopar.tools.launch import spawn

ATOL, RTOL = 1e-5, 1e-4


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    try:
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def _loss(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):  # hand-written code's (logits, loss)
        return out[-1]
    return out["loss"] if isinstance(out, dict) else out.loss


def _fresh(value: object) -> object:
    """Another batch like ``value``: new token ids, labels or pixels; options stay."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return torch.randn_like(value)
    return torch.randint_like(value, 0, int(value.max()) + 1)


# tied weights (an unused twin placeholder), uninitialised buffers (empty_like) and nested splits
_DIVERGENCE_CHECKED = {"gpt2", "t5", "deepseek-v3", "small-resnet"}


def _time_limit(name: str) -> float:
    """4 s of solver time a model; a model whose heads are split over tp by annotation is given the
    time to plan the mesh's axes apart (within 4 s they are planned together, and its attention
    then splits the batch over both)."""
    return 30.0 if name.endswith("(heads over tp)") else 4.0


def _train(name: str, mesh: object, on_first_call: bool, recompute: str | None = None) -> dict:
    from autopar.tools.numerics import first_divergence
    from tests.zoo_models import build, repeated_blocks

    torch.manual_seed(0)
    model, args, kwargs = build(name)
    reference = copy.deepcopy(model)
    for block in repeated_blocks(model) if recompute else ():
        autopar.recompute(block, recompute)
    if on_first_call:
        dmodel = autopar.compile(model, mesh, cluster="fast-links", time_limit=_time_limit(name))
    else:
        dmodel = autopar.compile(
            model, mesh, args, example_kwargs=kwargs, cluster="fast-links", time_limit=_time_limit(name)
        )
    if name in _DIVERGENCE_CHECKED:  # the numerics tool finds no difference where there is none
        assert first_divergence(dmodel, reference, *args, **kwargs) is None, name
    opt, ref_opt = None, torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(2):
        torch.manual_seed(100 + step)
        batch_args = tuple(_fresh(a) for a in args)
        batch_kwargs = {k: _fresh(v) for k, v in kwargs.items()}
        if on_first_call:
            out = dmodel(*batch_args, **batch_kwargs)
        else:
            local_args, local_kwargs = dmodel.shard_inputs(*batch_args, **batch_kwargs)
            out = dmodel(*local_args, **local_kwargs)
        ref_out = reference(*batch_args, **batch_kwargs)
        where = f"{name}, step {step}"
        _check(_loss(out), _loss(ref_out), f"{where}: loss")
        if isinstance(out, dict) and "accuracy" in out:
            assert out["accuracy"] == pytest.approx(ref_out["accuracy"]), where
        _loss(out).backward()
        _loss(ref_out).backward()
        for pname, p in dmodel.named_parameters():
            ref_grad = reference.get_parameter(pname).grad
            got = p.grad.full_tensor() if p.grad is not None else None
            if ref_grad is None or got is None:
                assert got is None or not got.any(), f"{where}: {pname} has a gradient one device lacks"
                continue
            _check(got, ref_grad, f"{where}: grad of {pname}")
        opt = opt or torch.optim.SGD(dmodel.parameters(), lr=0.05)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for bname, b in dmodel.named_buffers():
            whole = b.full_tensor() if hasattr(b, "full_tensor") else b
            _check(whole, reference.get_buffer(bname), f"{where}: buffer {bname}")
    attention = [n.operands[0] for n in dmodel.plan.nodes if "scaled_dot_product" in n.op]
    return {
        "warnings": list(dmodel.plan.warnings),
        "splits": sorted(set(dmodel.plan.inputs.values())),
        "attention": attention,
    }


#: Models trained again with every repeated block recomputed: batch norm updates its running
#: statistics in place (kept out of the checkpoint, applied once), and an encoder's blocks.
_RECOMPUTED = [("resnet", "full"), ("bert", "selective")]
#: Trained again on a mesh of tp=4, where its 5 heads split with one rank holding none.
_EMPTY_HEADS = "mini-gpt (5 heads)"


def _zoo_world(names: list[str]) -> dict:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # heads split as DTensor splits 5 rows over 4 ranks: 2, 2, 1 and none
    wide = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    runs = [(name, name, mesh, None) for name in names]
    runs += [(f"{name} ({recompute} recompute)", name, mesh, recompute) for name, recompute in _RECOMPUTED]
    runs += [(f"{_EMPTY_HEADS} over tp=4", _EMPTY_HEADS, wide, None)]
    results = {}
    for where, name, on, recompute in runs:  # every model runs, so one failure does not hide another's
        try:
            results[where] = _train(name, on, on_first_call=name == "llama", recompute=recompute)
        except Exception as e:  # noqa: BLE001 - reported by the test, with the model's name
            results[where] = {"error": f"{type(e).__name__}: {e}"}
    return results


@pytest.mark.distributed
def test_the_model_zoo_trains_on_4_gloo_ranks_as_on_one_device():
    from tests.zoo_models import ZOO

    results = spawn(_zoo_world, 4, list(ZOO))[0]
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not errors, errors
    fallbacks = {name: [w for w in r["warnings"] if "no sharding rule" in w] for name, r in results.items()}
    assert not any(fallbacks.values()), fallbacks
    assert len(results) >= 21 + len(_RECOMPUTED)
    assert set(results[f"{_EMPTY_HEADS} over tp=4"]["attention"]) == {"S(1)"}  # split by heads
    for name in (name for name in results if name.endswith(("(heads over tp)", "unequal parts)"))):
        assert {format_layout(parse_layout(lay)[-1:]) for lay in results[name]["attention"]} == {"S(1)"}, name
