"""Convolutions, 1-3d, plain and transposed, grouped and depthwise.

A convolution is a matrix product over channels slid over space:

* the batch splits freely;
* ungrouped, the output channels split (weight and bias split with them) and the input
  channels are summed: split, each rank holds a partial sum (the bias added once);
* grouped, channels split only by whole groups: input and output channels of one group
  stay together, so the split count must divide the number of groups (``extents``);
* a spatial dim splits only where no window crosses a piece's edge: kernel equal to
  stride, no padding or dilation (a patch embedding, a 1x1 convolution), the input an
  exact multiple of the stride. Anything else would need halo exchange, so it stays whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autopar.rules import DimSpec, Labels, OpCall, fresh, rule

aten = torch.ops.aten


def _per_dim(value: object, n: int, default: int) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    if isinstance(value, int):
        return (value,) * n
    values = tuple(value)
    return values * n if len(values) == 1 else values


def _patchwise(call: OpCall, n_spatial: int, x: Sequence[int], out: Sequence[int]) -> list[bool]:
    """Per spatial dim: whether each output position reads only its own input piece."""
    kernel = call.shapes[1][2:]
    stride = _per_dim(call.arg("stride"), n_spatial, 1)
    padding = call.arg("padding")
    dilation = _per_dim(call.arg("dilation"), n_spatial, 1)
    if padding == "same":
        return [False] * n_spatial
    pads = _per_dim(0 if padding == "valid" else padding, n_spatial, 0)
    return [
        kernel[d] == stride[d] and pads[d] == 0 and dilation[d] == 1 and x[d] == out[d] * stride[d]
        for d in range(n_spatial)
    ]


def _convolution(call: OpCall, transposed: bool, groups: int) -> DimSpec:
    x, w = call.shapes[0], call.shapes[1]
    n_spatial = len(w) - 2
    batched = len(x) == n_spatial + 2
    out = call.out_shapes[0]
    n, i, o, c = fresh(4)
    space = fresh(n_spatial, n + i + o + c)
    splits = (
        [False] * n_spatial if transposed else _patchwise(call, n_spatial, x[-n_spatial:], out[-n_spatial:])
    )
    spatial: Labels = tuple(space[d] if ok else None for d, ok in enumerate(splits))
    lead: Labels = (n,) if batched else ()
    kernel: Labels = (None,) * n_spatial
    flops = 2 * math.prod(x if transposed else out) * w[1] * math.prod(w[2:])
    if groups == 1:
        weight: Labels = (i, o, *kernel) if transposed else (o, i, *kernel)
        operands: tuple[Labels, ...] = ((*lead, i, *spatial), weight)
        if len(call.operands) == 3:
            operands = (*operands, (o,))
        return DimSpec(
            operands, ((*lead, o, *spatial),), summed=frozenset(i), additive=frozenset({2}), flops=flops
        )
    weight = (c, None, *kernel)
    operands = ((*lead, c, *spatial), weight) + (((c,),) if len(call.operands) == 3 else ())
    return DimSpec(
        operands, ((*lead, c, *spatial),), extents=((c, groups),), counts=(("groups", c),), flops=flops
    )


@rule(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, anchor=True)
@rule(aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding, anchor=True)
def conv(call: OpCall) -> DimSpec:
    return _convolution(call, transposed=False, groups=int(call.arg("groups", 1)))


@rule(aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input, anchor=True)
def conv_transpose(call: OpCall) -> DimSpec:
    return _convolution(call, transposed=True, groups=int(call.arg("groups", 1)))


@rule(aten.convolution.default, anchor=True)
def convolution(call: OpCall) -> DimSpec:
    return _convolution(call, transposed=bool(call.arg("transposed")), groups=int(call.arg("groups")))
