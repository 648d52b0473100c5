"""Pooling and interpolation: windows over the trailing spatial dims.

The batch and channel dims split freely; the spatial dims stay whole, since a window
(or an interpolation stencil, or an adaptive pool's bins) may cross a piece's edge.
"""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, fresh, rule

aten = torch.ops.aten


def _spatial_whole(call: OpCall, n_spatial: int) -> DimSpec:
    x = call.shapes[0]
    labels = fresh(len(x) - n_spatial)
    lead = tuple(labels)
    operands = ((*lead, *(None,) * n_spatial),)
    outputs = tuple((*lead, *(None,) * (len(o) - len(lead))) for o in call.out_shapes)
    return DimSpec(operands, outputs, flops=math.prod(x) + sum(math.prod(o) for o in call.out_shapes))


def _by_rank(n_spatial: int):
    def spec(call: OpCall) -> DimSpec:
        return _spatial_whole(call, n_spatial)

    return spec


_POOLS = {
    1: (
        aten.max_pool1d.default,
        aten.avg_pool1d.default,
        aten.adaptive_avg_pool1d.default,
        aten.adaptive_max_pool1d.default,
        aten.max_pool1d_with_indices.default,
    ),
    2: (
        aten.max_pool2d.default,
        aten.avg_pool2d.default,
        aten.adaptive_avg_pool2d.default,
        aten.adaptive_max_pool2d.default,
        aten.max_pool2d_with_indices.default,
        aten._adaptive_avg_pool2d.default,
    ),
    3: (
        aten.max_pool3d.default,
        aten.avg_pool3d.default,
        aten.adaptive_avg_pool3d.default,
        aten.adaptive_max_pool3d.default,
        aten.max_pool3d_with_indices.default,
    ),
}
_INTERPOLATIONS = {
    1: (aten.upsample_nearest1d.vec, aten.upsample_linear1d.vec, aten._upsample_nearest_exact1d.vec),
    2: (
        aten.upsample_nearest2d.vec,
        aten.upsample_bilinear2d.vec,
        aten.upsample_bicubic2d.vec,
        aten._upsample_nearest_exact2d.vec,
        aten._upsample_bilinear2d_aa.vec,
    ),
    3: (aten.upsample_nearest3d.vec, aten.upsample_trilinear3d.vec, aten._upsample_nearest_exact3d.vec),
}

for _n, _ops in (*_POOLS.items(), *_INTERPOLATIONS.items()):
    rule(*_ops)(_by_rank(_n))
