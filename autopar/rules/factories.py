"""Factories: tensors made from nothing (or from another tensor's dtype) are replicated.

Their consumers take a free local slice when they need a split.
"""

from __future__ import annotations

import torch

from autopar.rules import DimSpec, OpCall, rule

aten = torch.ops.aten


@rule(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_full.default,
    aten.lift_fresh_copy.default,
)
def factory(call: OpCall) -> DimSpec:
    # operands (if any) only lend dtype/device, or are small constants: any layout
    return DimSpec(tuple(None for _ in call.shapes), tuple((None,) * len(s) for s in call.out_shapes))


@rule(torch.ops.higher_order.wrap_with_set_grad_enabled)
def no_grad_region(call: OpCall) -> DimSpec:
    # a region exported under torch.no_grad (e.g. Llama's rotary tables): small and
    # gradient-free, so it runs whole on every rank from whole inputs
    return DimSpec(
        tuple((None,) * len(s) for s in call.shapes), tuple((None,) * len(s) for s in call.out_shapes)
    )
