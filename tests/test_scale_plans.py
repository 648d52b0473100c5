"""Plans at the scale of published runs (issue 44), on meta: layouts on axes of one device, the
solver's plan against plans users write by annotation."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.ir.layout import on_one_device_whole
from autopar.ir.mesh import MeshSpec
from examples import gpt

SMALL = dict(vocab_size=512, seq_len=64, d_model=64, n_heads=4, n_layers=2, d_ff=256)


def test_a_layout_on_an_axis_of_one_device_is_whole_there():
    mesh = MeshSpec.of({"dp": 4, "tp": 1})
    assert on_one_device_whole((Shard(0), Shard(1)), mesh) == (Shard(0), Replicate())
    assert on_one_device_whole((Shard(0), Partial()), mesh) == (Shard(0), Replicate())
    whole = MeshSpec.of({"dp": 4, "tp": 2})
    assert on_one_device_whole((Shard(0), Shard(1)), whole) == (Shard(0), Shard(1))


def _megatron_on_tp_of_one(annotate: bool) -> autopar.Plan:
    model, args = gpt.build(device="meta", batch_size=8, **SMALL)
    for block in model.blocks:
        autopar.recompute(block, "full")
        if annotate:
            for linear in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):
                autopar.shard(linear, parameter_plan={"weight": ("tp", None), "bias": ("tp",)})
            for linear in (block.attn.proj, block.mlp.proj):
                autopar.shard(linear, parameter_plan={"weight": (None, "tp")})
            autopar.shard(block, in_strategy=(("dp", None, None),), out_strategy=(("dp", None, None),))
        else:
            for module in block.modules():
                direct = dict(module.named_parameters(recurse=False))
                if direct:
                    autopar.shard(module, parameter_plan={n: (None,) * p.dim() for n, p in direct.items()})
    return autopar.plan(model, args, {"dp": 4, "tp": 1}, cluster="a100", memory=autopar.Memory(zero=0))


def test_megatron_layouts_on_a_tensor_axis_of_one_device_are_data_parallel():
    """Megatron's column/row splits and a batch-split stream on ``tp=1`` are the same tensors as plain
    data parallelism: no copy kept in a recompute region, no redistribution (they were counted as
    copies: 51 GiB of activations against 10 GiB on the 1.7B row of Megatron's Table 1)."""
    megatron, replicated = _megatron_on_tp_of_one(True), _megatron_on_tp_of_one(False)
    assert megatron.prediction.activation_bytes == replicated.prediction.activation_bytes
    assert megatron.prediction.comm_bytes == replicated.prediction.comm_bytes
    assert len(megatron.redistributions) == len(replicated.redistributions)
