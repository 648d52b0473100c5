"""Attention: scaled_dot_product_attention (an anchor)."""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, broadcast, rule

aten = torch.ops.aten


@rule(aten.scaled_dot_product_attention.default, anchor=True)
def sdpa(call: OpCall) -> DimSpec:
    # q: ...LE, k: ...SE, v: ...SF -> ...LF. Batch and head dims split freely; query
    # rows split too (each rank attends its rows to all keys) unless the mask is the
    # implicit causal one, which assumes rows and keys start together. Key, head and
    # value dims stay whole: softmax runs over S.
    q, k, v = call.shapes[:3]
    batch = tuple("ABCDEFGH"[: len(q) - 2])
    operands: list = [(*batch, "L", "E"), (*batch, "S", "E"), (*batch, "S", "F")]
    if len(call.shapes) == 4:
        (mask,), out = broadcast([call.shapes[3]], (*q[:-1], k[-2]))
        rename = dict(zip(out, (*batch, "L", "S")))
        operands.append(tuple(rename[lab] if lab else None for lab in mask))
    whole = {"S", "E", "F"}
    if call.arg("is_causal", False):
        whole.add("L")
    scores = math.prod(q[:-1]) * k[-2]
    flops = 2 * scores * (q[-1] + v[-1])
    # the kernels skip the key blocks after a query block only under the implicit causal mask
    causal = q[-2] if call.arg("is_causal", False) and q[-2] == k[-2] else 0
    # an exp per score in forward, and again in backward (flash attention recomputes them)
    return DimSpec(
        tuple(operands),
        ((*batch, "L", "F"),),
        whole=frozenset(whole),
        flops=flops,
        transcendentals=(scores, scores),
        attention=(scores, causal),
    )
