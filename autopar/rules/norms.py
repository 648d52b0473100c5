"""Normalisations: layer, rms, batch, group and instance norms, (log_)softmax; normalised dims stay whole."""

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
def softmax(call: OpCall) -> DimSpec | None:
    (x,) = call.shapes
    if not x:
        return None  # a 0-d value (its dim 0 is the value itself): not covered
    labels = fresh(len(x))
    dim = call.arg("dim") % len(x)
    n = math.prod(x)
    log = call.node.target in (aten._log_softmax.default, aten.log_softmax.int)
    return DimSpec(
        (tuple(labels),),
        (tuple(labels),),
        whole=frozenset(labels[dim]),
        flops=5 * n,
        transcendentals=(n, n if log else 0),  # an exp each; log_softmax's backward exps again
    )


@rule(aten.batch_norm.default)
def batch_norm(call: OpCall) -> DimSpec | None:
    # (n, c, *space): per-channel statistics. In eval (running statistics used) every dim
    # splits. Training normalises by statistics over the batch and space, so only channels
    # split; with running statistics the op also updates them in place, which a rank's
    # piece of the buffer cannot take: capture records that case as plain means instead
    # (capture/exact_means.py), and an op seen here anyway stays replicated and listed.
    x = call.shapes[0]
    if len(x) < 2:
        return None  # no channel dim (a 1-d input): not covered
    labels = fresh(len(x))
    channel = labels[1]
    training = bool(call.arg("training"))
    if training and call.arg("running_mean") is not None:
        return None
    operands = (tuple(labels), *((channel,) for _ in call.shapes[1:]))
    whole = frozenset(labels) - {channel} if training else frozenset()
    return DimSpec(operands, (tuple(labels),), whole=whole, flops=5 * math.prod(x))


@rule(aten.group_norm.default)
def group_norm(call: OpCall) -> DimSpec:
    # (n, c, *space) normalised over each group of channels and all of space: the batch
    # splits, the rest stays whole (a channel split would change the op's group count).
    x = call.shapes[0]
    labels = fresh(len(x))
    operands = (tuple(labels), *((labels[1],) for _ in call.shapes[1:]))
    return DimSpec(operands, (tuple(labels),), whole=frozenset(labels[1:]), flops=5 * math.prod(x))


@rule(aten.instance_norm.default)
def instance_norm(call: OpCall) -> DimSpec | None:
    # per sample and channel over space: batch and channels split. Running statistics
    # (track_running_stats) average over the batch and update buffers in place: replicated.
    if call.arg("running_mean") is not None:
        return None
    x = call.shapes[0]
    labels = fresh(len(x))
    operands = (tuple(labels), *((labels[1],) for _ in call.shapes[1:]))
    return DimSpec(operands, (tuple(labels),), whole=frozenset(labels[2:]), flops=5 * math.prod(x))
