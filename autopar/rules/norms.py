"""Normalisations: layer_norm, rms_norm, softmax, log_softmax (normalised dims stay whole)."""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, fresh, rule

aten = torch.ops.aten


@rule(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(call: OpCall) -> DimSpec:
    # ...N, N, N -> ...N with the normalised dims N whole; leading dims split freely
    # (Megatron sequence parallelism runs norms on sequence shards this way).
    x = call.shapes[0]
    n_norm = len(call.arg("normalized_shape"))
    labels = fresh(len(x))
    norm = tuple(labels[len(x) - n_norm :])
    operands = (tuple(labels), *(norm for _ in call.shapes[1:]))
    return DimSpec(operands, (tuple(labels),), whole=frozenset(norm), flops=5 * math.prod(x))


@rule(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def softmax(call: OpCall) -> DimSpec:
    (x,) = call.shapes
    labels = fresh(len(x))
    dim = call.arg("dim") % len(x)
    return DimSpec((tuple(labels),), (tuple(labels),), whole=frozenset(labels[dim]), flops=5 * math.prod(x))
