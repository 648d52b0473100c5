"""The rules of convolutional nets (convolutions, pooling, interpolation, batch/group/instance
norms) checked against single-device results with the harness of ``test_rules``; and the
planner keeps tensors updated in place whole."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.rules import OpCall, enumerate_strategies, lookup
from tests import test_rules as harness  # the module, so pytest does not collect its tests twice
from tests.test_rules import MESHES, make_node, r

aten = torch.ops.aten

CASES = [
    (aten.conv2d.default, (r(4, 4, 6, 6), r(6, 4, 3, 3), r(6), [1, 1], [1, 1]), {}),
    (aten.conv2d.default, (r(4, 4, 6, 6), r(4, 2, 3, 3), r(4), [1, 1], [1, 1], [1, 1], 2), {}),
    (aten.conv2d.default, (r(2, 4, 6, 6), r(4, 1, 3, 3), None, [2, 2], [1, 1], [1, 1], 4), {}),
    (aten.conv2d.default, (r(2, 3, 8, 8), r(6, 3, 2, 2), r(6), [2, 2]), {}),
    (aten.conv2d.default, (r(4, 6, 6), r(4, 4, 1, 1)), {}),
    (aten.conv2d.padding, (r(2, 4, 6, 6), r(4, 4, 3, 3), r(4), [1, 1], "same"), {}),
    (aten.conv1d.default, (r(2, 4, 8), r(6, 4, 3), r(6)), {}),
    (aten.conv3d.default, (r(2, 2, 4, 4, 4), r(4, 2, 1, 1, 1), r(4)), {}),
    (aten.conv_transpose2d.input, (r(2, 4, 4, 4), r(4, 6, 2, 2), r(6), [2, 2]), {}),
    (aten.conv_transpose2d.input, (r(2, 4, 4, 4), r(4, 2, 3, 3), r(4), [1, 1], [1, 1], [0, 0], 2), {}),
    (
        aten.convolution.default,
        (r(2, 4, 6, 6), r(6, 4, 3, 3), r(6), [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        {},
    ),
    (aten.max_pool2d.default, (r(2, 4, 6, 6), [2, 2]), {}),
    (aten.avg_pool2d.default, (r(2, 4, 5, 5), [2, 2], [], [0, 0], True), {}),
    (aten.adaptive_avg_pool2d.default, (r(2, 4, 6, 6), [3, 3]), {}),
    (aten.adaptive_max_pool2d.default, (r(2, 4, 6, 6), [2, 2]), {}),
    (aten.max_pool1d.default, (r(2, 4, 6), [2]), {}),
    (aten.upsample_nearest2d.vec, (r(2, 4, 3, 3), None, [2.0, 2.0]), {}),
    (aten.upsample_bilinear2d.vec, (r(2, 4, 3, 3), [6, 6], False, None), {}),
    (aten.batch_norm.default, (r(4, 4, 3, 3), r(4), r(4), r(4), r(4).abs(), False, 0.1, 1e-5, False), {}),
    (aten.batch_norm.default, (r(4, 4, 3, 3), r(4), r(4), None, None, True, 0.1, 1e-5, False), {}),
    (aten.group_norm.default, (r(4, 4, 3, 3), 2, r(4), r(4), 1e-5, False), {}),
    (aten.instance_norm.default, (r(4, 4, 3, 3), r(4), r(4), None, None, True, 0.1, 1e-5, False), {}),
]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("op,args,kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_cnn_rule_matches_single_device(op, args, kwargs, mesh):
    harness.test_rule_matches_single_device(op, args, kwargs, mesh)


def _input_layouts(op, args) -> set:
    node = make_node(op, args, {})
    call = OpCall.of(node)
    spec = lookup(op).fn(call)
    return {s.operands[0] for s in enumerate_strategies(spec, call.shapes, call.out_shapes, MESHES[0])}


def test_convolutions_split_what_is_exact():
    # ungrouped 3x3: batch, output channels, input channels (Partial); never space
    assert _input_layouts(aten.conv2d.default, (r(4, 4, 6, 6), r(6, 4, 3, 3), None, [1, 1], [1, 1])) == {
        (Replicate(),),
        (Shard(0),),
        (Shard(1),),
    }
    # a patch embedding splits space too
    assert (Shard(2),) in _input_layouts(aten.conv2d.default, (r(2, 3, 8, 8), r(6, 3, 2, 2), None, [2, 2]))
    # three groups do not split in two
    grouped = _input_layouts(aten.conv2d.default, (r(2, 6, 4, 4), r(6, 2, 3, 3), None, [1], [1], [1], 3))
    assert grouped == {(Replicate(),), (Shard(0),)}


def test_training_batch_norm_with_running_stats_is_not_covered():
    """It updates its running statistics in place: capture records it as means instead."""
    node = make_node(
        aten.batch_norm.default, (r(4, 4, 3), r(4), r(4), r(4), r(4).abs(), True, 0.1, 1e-5, False), {}
    )
    assert lookup(aten.batch_norm.default).fn(OpCall.of(node)) is None
