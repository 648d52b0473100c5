"""Element-wise ops with broadcasting: every output dim is a label shared by the
operand dims that broadcast to it.

Linearity decides what a Partial operand may do: ``add``/``sub`` of tensors are
linear in (and additive over) all operands, ``mul`` is linear in each operand
alone, ``div`` in its numerator, casts and copies in their input. Non-linear ops
(activations, comparisons, dropout) need a Partial operand reduced first.
"""

from __future__ import annotations

import math

import torch

from autopar.ir.ops import written_operand
from autopar.rules import DimSpec, OpCall, broadcast, fallback, rule

aten = torch.ops.aten


# Transcendental functions (exp, log, erf, trigonometric, hyperbolic) each output element of an
# op evaluates in forward and in backward, counted as XLA's cost analysis counts them: GELU's
# forward an erf, its backward the erf and the Gaussian's exp; SiLU's backward recomputes its
# sigmoid. The cost model prices every one at exp's rate, but where calibrate timed the function
# (TIMED_FUNCTIONS below) at that function's own rate.
TRANSCENDENTALS: dict[object, tuple[int, int]] = {
    aten.gelu.default: (1, 2),
    aten.silu.default: (1, 1),
    aten.mish.default: (3, 3),
    aten.softplus.default: (2, 1),
    aten.logaddexp.default: (2, 2),
    aten.pow.Tensor_Tensor: (2, 2),
    **dict.fromkeys(
        (
            aten.erf.default,
            aten.erfc.default,
            aten.erfinv.default,
            aten.sin.default,
            aten.cos.default,
            aten.sinh.default,
            aten.cosh.default,
        ),
        (1, 1),
    ),
    **dict.fromkeys(
        (
            aten.tanh.default,
            aten.sigmoid.default,
            aten.exp.default,
            aten.exp2.default,
            aten.expm1.default,
            aten.log.default,
            aten.log1p.default,
            aten.log2.default,
            aten.log10.default,
            aten.logit.default,
            aten.xlogy.Tensor,
            aten.tan.default,
            aten.atan.default,
            aten.asin.default,
            aten.acos.default,
            aten.atan2.default,
            aten.elu.default,
            aten.selu.default,
            aten.celu.default,
        ),
        (1, 0),
    ),
}


# The elementwise functions whose rates `autopar calibrate` measures (``Cluster.function_rates``),
# which then price them in place of their transcendental count: a CPU computes them at rates
# several times apart (docs/cost_model.md). Name -> the op and its keyword arguments; the
# functions whose backward computes them again have that backward timed too, named
# ``<name>_backward`` (:data:`TIMED_BACKWARD`: the op, called with the output's gradient and the
# input).
TIMED_FUNCTIONS: dict[str, tuple[torch._ops.OpOverload, dict[str, str]]] = {
    "exp": (aten.exp.default, {}),
    "log": (aten.log.default, {}),
    "erf": (aten.erf.default, {}),
    "tanh": (aten.tanh.default, {}),
    "sigmoid": (aten.sigmoid.default, {}),
    "silu": (aten.silu.default, {}),
    "gelu": (aten.gelu.default, {}),
    "gelu_tanh": (aten.gelu.default, {"approximate": "tanh"}),
}
TIMED_BACKWARD: dict[str, tuple[torch._ops.OpOverload, dict[str, str]]] = {
    "silu": (aten.silu_backward.default, {}),
    "gelu": (aten.gelu_backward.default, {}),
    "gelu_tanh": (aten.gelu_backward.default, {"approximate": "tanh"}),
}


def timed_function(node: torch.fx.Node) -> str | None:
    """The name in :data:`TIMED_FUNCTIONS` of the function ``node`` computes, if any (GELU's
    ``approximate`` is keyword-only: its one argument that changes the function)."""
    approximate = node.kwargs.get("approximate", "none")
    for name, (op, kwargs) in TIMED_FUNCTIONS.items():
        if node.target is op and kwargs.get("approximate", "none") == approximate:
            return name
    return None


def _pointwise(
    call: OpCall, linear: frozenset[int] = frozenset(), additive: frozenset[int] = frozenset()
) -> DimSpec:
    (out_shape, *more) = call.out_shapes
    operands, out = broadcast(call.shapes, out_shape)
    outs = (out, *(out for _ in more))
    n = math.prod(out_shape)
    forward, backward = TRANSCENDENTALS.get(call.node.target, (0, 0))
    return DimSpec(
        operands,
        outs,
        linear=linear,
        additive=additive,
        flops=n,
        transcendentals=(forward * n, backward * n),
        function=timed_function(call.node),
    )


def _all(call: OpCall) -> frozenset[int]:
    return frozenset(range(len(call.operands)))


@rule(aten.add.Tensor, aten.sub.Tensor)
def add(call: OpCall) -> DimSpec:
    # a Python scalar term would be added once per rank, so only tensor sums are linear
    tensors_only = len(call.operands) == 2
    ops = _all(call) if tensors_only else frozenset()
    return _pointwise(call, linear=ops, additive=ops)


@rule(aten.mul.Tensor, aten.mul.Scalar)
def mul(call: OpCall) -> DimSpec:
    return _pointwise(call, linear=_all(call))


@rule(aten.div.Tensor, aten.div.Scalar)
def div(call: OpCall) -> DimSpec:
    return _pointwise(call, linear=frozenset({0}))


@rule(aten.where.self)
def where(call: OpCall) -> DimSpec:
    # where(c, x, y) is linear in x and y together; the condition must be whole-valued
    both = frozenset(i for i, n in enumerate(call.operands) if n is not call.node.args[0])
    return _pointwise(call, linear=both, additive=both)


@rule(
    aten.neg.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.detach_.default,  # in place, but changes no value: a redistributed copy may take it
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.type_as.default,
)
def linear_unary(call: OpCall) -> DimSpec:
    return _pointwise(call, linear=frozenset({0}))


@rule(
    aten.gelu.default,
    aten.silu.default,
    aten.relu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.exp.default,
    aten.log.default,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.erf.default,
    aten.abs.default,
    aten.sin.default,
    aten.cos.default,
    aten.reciprocal.default,
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.minimum.default,
    aten.maximum.default,
    aten.min.other,
    aten.max.other,
    aten.where.ScalarOther,  # a scalar branch would be taken once per rank: not linear
    aten.where.ScalarSelf,
    aten.dropout.default,
    aten.native_dropout.default,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.bitwise_not.default,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_not.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.rand_like.default,
    aten.isnan.default,
    aten.sign.default,
    aten.broadcast_tensors.default,
    aten.hardtanh.default,
    aten.hardswish.default,
    aten.hardsigmoid.default,
    aten.leaky_relu.default,
    aten.elu.default,
    aten.selu.default,
    aten.celu.default,
    aten.softplus.default,
    aten.mish.default,
    aten.relu6.default,
    aten.log1p.default,
    aten.expm1.default,
    aten.log2.default,
    aten.log10.default,
    aten.exp2.default,
    aten.erfc.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.trunc.default,
    aten.frac.default,
    aten.logit.default,
    aten.square.default,
    aten.atan.default,
    aten.tan.default,
    aten.asin.default,
    aten.acos.default,
    aten.sinh.default,
    aten.cosh.default,
    aten.erfinv.default,
    aten.nan_to_num.default,
    aten.isinf.default,
    aten.isfinite.default,
    aten.signbit.default,
    aten.xlogy.Tensor,
    aten.hypot.default,
    aten.atan2.default,
    aten.fmod.Tensor,
    aten.fmod.Scalar,
    aten.logaddexp.default,
    aten.copysign.Tensor,
    aten.threshold.default,
)
def nonlinear(call: OpCall) -> DimSpec:
    return _pointwise(call)


@rule(
    aten.add_.Tensor,
    aten.add_.Scalar,
    aten.sub_.Tensor,
    aten.sub_.Scalar,
    aten.mul_.Tensor,
    aten.mul_.Scalar,
    aten.div_.Tensor,
    aten.div_.Scalar,
    aten.copy_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.lerp_.Scalar,
    aten.lerp_.Tensor,
    aten.addcmul_.default,
    aten.clamp_.default,
)
def update_in_place(call: OpCall) -> DimSpec | None:
    # An update of a model input or buffer (BatchNorm's running statistics, a step
    # counter, an EMA) writes the tensor where it is stored; the planner stores such
    # tensors replicated, so the update runs replicated on whole operands. In-place ops on
    # intermediate values are captured as their out-of-place forms where that is exact;
    # any left here are not covered (replicated and listed).
    target = written_operand(call.node)
    if target is None or target.op != "placeholder":
        return None
    return fallback(call)
