"""Shape ops: view/reshape, transpose/permute, (un)squeeze, expand, repeat(_interleave),
slice/select, split/chunk/unbind, cat/stack, pad, diff, cumsum, flip, tril/triu, complex numbers as
pairs of reals (view_as_complex, view_as_real).

All move data without arithmetic, so all are linear: a Partial operand passes through.
"""

from __future__ import annotations

import math

import torch

from autopar.rules import DimSpec, OpCall, fresh, rule

aten = torch.ops.aten
LINEAR = frozenset({0})


def reshape_labels(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple, tuple, frozenset[str]] | None:
    """Labels for a contiguous reshape ``src -> dst``; None where its dims do not group into runs
    (empty dims on one side that the other lacks: ``(4, 0) -> (0,)``).

    Dimensions are grouped into runs with equal products; within a run only the
    leading (outermost) dimension may be split, and it carries the same label on
    both sides: splitting it splits the run's memory into contiguous blocks, which
    is the same on both sides when both leading sizes divide. Size-1 dims get None.
    """
    names = iter(fresh(len(src) + len(dst) + 1))
    src_l: list = [None] * len(src)
    dst_l: list = [None] * len(dst)
    whole: set[str] = set()
    i = j = 0
    while i < len(src) or j < len(dst):
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i == len(src) or j == len(dst):
            break
        lead = next(names)
        src_l[i], dst_l[j] = lead, lead
        ps, pd = src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if (ps < pd and i == len(src)) or (ps > pd and j == len(dst)):
                return None  # the run never closes: an empty dim on one side only
            if ps < pd:
                src_l[i] = next(names)
                whole.add(src_l[i])
                ps *= src[i]
                i += 1
            else:
                dst_l[j] = next(names)
                whole.add(dst_l[j])
                pd *= dst[j]
                j += 1
    return tuple(src_l), tuple(dst_l), frozenset(whole)


@rule(
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
)
def view(call: OpCall) -> DimSpec | None:
    src, dst = call.shapes[0], call.out_shapes[0]
    labelled = reshape_labels(src, dst)
    if labelled is None:
        return None
    src_l, dst_l, whole = labelled
    return DimSpec((src_l,), (dst_l,), whole=whole, linear=LINEAR)


@rule(aten.transpose.int, aten.permute.default, aten.t.default, aten.numpy_T.default)
def permute(call: OpCall) -> DimSpec | None:
    (src,) = call.shapes
    if not src and call.node.target in (aten.transpose.int, aten.t.default):
        return None  # a transpose of a 0-d value (its dims 0 and -1 are the value itself): not covered
    labels = fresh(len(src))
    if call.node.target is aten.permute.default:
        order = [d % len(src) for d in call.arg("dims")]
    elif call.node.target is aten.numpy_T.default:  # x.T: every dim reversed
        order = list(reversed(range(len(src))))
    else:
        order = list(range(len(src)))
        d0, d1 = (call.arg("dim0", 0), call.arg("dim1", 1)) if len(src) > 1 else (0, 0)
        d0, d1 = d0 % len(src), d1 % len(src)
        order[d0], order[d1] = order[d1], order[d0]
    return DimSpec((tuple(labels),), (tuple(labels[d] for d in order),), linear=LINEAR)


@rule(aten.expand.default)
def expand(call: OpCall) -> DimSpec:
    # right-aligned; a broadcast dim is None in the input and a fresh (splittable) output dim
    src, dst = call.shapes[0], call.out_shapes[0]
    out = fresh(len(dst))
    offset = len(dst) - len(src)
    src_l = tuple(out[offset + i] if s == dst[offset + i] else None for i, s in enumerate(src))
    return DimSpec((src_l,), (tuple(out),), linear=LINEAR)


@rule(aten.repeat.default)
def repeat(call: OpCall) -> DimSpec:
    # a dim repeated more than once holds several copies of the input's dim: both stay
    # whole, as do the new leading dims (each rank would need its share of the count)
    src, dst = call.shapes[0], call.out_shapes[0]
    repeats = list(call.arg("repeats"))
    lead = len(repeats) - len(src)
    out = fresh(len(dst))
    src_l = tuple(out[lead + d] if repeats[lead + d] == 1 else f"{out[lead + d]}'" for d in range(len(src)))
    whole = frozenset(out[:lead]) | frozenset(
        out[lead + d] for d in range(len(src)) if repeats[lead + d] != 1
    )
    return DimSpec((src_l,), (tuple(out),), whole=whole, linear=LINEAR)


@rule(aten.repeat_interleave.self_int)
def repeat_interleave(call: OpCall) -> DimSpec | None:
    # each element repeated in place: a block of the dim gives the block of the output at
    # the same rank, so the dim splits with its input. Without a dim the input is flattened
    # first: only its leading dim splits, as in a reshape. A given output_size is global, and a
    # 0-d value has no dim to repeat in: neither is covered.
    if call.arg("output_size") is not None or not call.shapes[0]:
        return None
    labels = fresh(len(call.shapes[0]))
    if call.arg("dim") is None:
        return DimSpec((tuple(labels),), ((labels[0],),), whole=frozenset(labels[1:]), linear=LINEAR)
    return DimSpec((tuple(labels),), (tuple(labels),), linear=LINEAR)


def _keep_but(call: OpCall, dims: set[int], drop: bool = False) -> DimSpec:
    """Input dims in ``dims`` stay whole (and are dropped from the output if ``drop``)."""
    src = call.shapes[0]
    labels = fresh(len(src))
    out_l = [lab.upper() if d in dims else lab for d, lab in enumerate(labels)]
    if drop:
        out_l = [lab for d, lab in enumerate(out_l) if d not in dims]
    outs = tuple(tuple(out_l) for _ in call.out_shapes)
    whole = frozenset(labels[d] for d in dims) | frozenset(labels[d].upper() for d in dims)
    return DimSpec((tuple(labels), *(None for _ in call.shapes[1:])), outs, whole=whole, linear=LINEAR)


def _in_parts(call: OpCall, dim: int, counted: tuple[str, ...]) -> DimSpec:
    """Dim ``dim`` made of equal parts, one per output (see ``DimSpec.parts``): it splits as a
    strided shard, each output part plainly; the ``counted`` arguments (sizes and offsets
    along the dim) become this rank's share."""
    labels = fresh(len(call.shapes[0]))
    k = call.shapes[0][dim] // call.out_shapes[0][dim]
    return DimSpec(
        (tuple(labels), *(None for _ in call.shapes[1:])),
        tuple(tuple(labels) for _ in call.out_shapes),
        linear=LINEAR,
        parts=((labels[dim], k),),
        counts=tuple((name, labels[dim]) for name in counted),
    )


@rule(aten.slice.Tensor, aten.narrow.default)
def slice_(call: OpCall) -> DimSpec:
    # One of k equal parts (Phi-3's q, k and v out of its fused projection) is a part of a
    # strided dim; any other slice keeps its dim whole.
    src, dst = call.shapes[0], call.out_shapes[0]
    dim = call.arg("dim", 0) % len(src)
    if src[dim] == dst[dim]:
        return _keep_but(call, set())
    start = call.arg("start", 0) or 0
    if (
        call.node.target is aten.slice.Tensor
        and call.arg("step", 1) == 1
        and isinstance(start, int)
        and 0 < dst[dim] < src[dim]
        and src[dim] % dst[dim] == 0
        and start % dst[dim] == 0
        and 0 <= start < src[dim]
    ):
        return _in_parts(call, dim, tuple(name for name in ("start", "end") if call.arg(name) is not None))
    return _keep_but(call, {dim})


@rule(aten.select.int, aten.unbind.int)
def select(call: OpCall) -> DimSpec:
    return _keep_but(call, {call.arg("dim", 0) % len(call.shapes[0])}, drop=True)


@rule(aten.slice_scatter.default, aten.select_scatter.default)
def scatter_into_view(call: OpCall) -> DimSpec:
    # base with src written into a slice (select) of dim d: d whole, the rest shared. Linear
    # in base and src together (partial sums of both scatter into partial sums).
    base = call.shapes[0]
    dim = call.arg("dim", 0) % len(base)
    labels = fresh(len(base))
    keeps_dim = call.node.target is aten.slice_scatter.default  # select_scatter's src lacks it
    src = tuple(lab for d, lab in enumerate(labels) if d != dim or keeps_dim)
    both = frozenset({0, 1})
    return DimSpec(
        (tuple(labels), src), (tuple(labels),), whole=frozenset(labels[dim]), linear=both, additive=both
    )


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split(call: OpCall) -> DimSpec | None:
    # equal parts (q, k and v of GPT-2's fused projection; gate and up) split strided
    ndim = len(call.shapes[0])
    dim = call.arg("dim", 0) % ndim
    pieces = [shape[dim] for shape in call.out_shapes]
    if len(pieces) < 2 or len(set(pieces)) != 1 or pieces[0] * len(pieces) != call.shapes[0][dim]:
        return _keep_but(call, {dim})
    if not pieces[0]:
        return None  # an empty dim cut into empty parts: not covered
    counted = {aten.split.Tensor: ("split_size",), aten.split_with_sizes.default: ("split_sizes",)}
    return _in_parts(call, dim, counted.get(call.node.target, ()))


@rule(
    aten.flip.default,
    aten.cumsum.default,
    aten.roll.default,
)
def along_dims(call: OpCall) -> DimSpec | None:
    ndim = len(call.shapes[0])
    dims = call.arg("dims") if call.arg("dims") is not None else [call.arg("dim", 0)]
    if not ndim and dims:
        return None  # a dim of a 0-d value (its dim 0 is the value itself): not covered
    if not dims and call.node.target is aten.roll.default:
        dims = range(ndim)  # roll without dims rolls the flattened value: every dim takes part
    return _keep_but(call, {d % ndim for d in dims})


@rule(aten.tril.default, aten.triu.default)
def triangle(call: OpCall) -> DimSpec:
    ndim = len(call.shapes[0])
    return _keep_but(call, {ndim - 2, ndim - 1})


@rule(aten.diff.default)
def diff(call: OpCall) -> DimSpec:
    # prepend/append share every label but the differenced dim
    ndim = len(call.shapes[0])
    dim = call.arg("dim", -1) % ndim
    labels = fresh(ndim)
    out = tuple(lab.upper() if d == dim else lab for d, lab in enumerate(labels))
    extra = tuple(
        tuple(lab.lower() + "'" if d == dim else lab for d, lab in enumerate(labels)) for _ in call.shapes[1:]
    )
    whole = frozenset({labels[dim], out[dim], labels[dim] + "'"})
    return DimSpec(
        (tuple(labels), *extra),
        (out,),
        whole=whole,
        linear=frozenset(range(len(call.shapes))),
        additive=frozenset(range(len(call.shapes))),
    )


@rule(aten.cat.default)
def cat(call: OpCall) -> DimSpec:
    # every input shares all labels but the concatenated dim (legacy empty 1-D inputs are free)
    out = call.out_shapes[0]
    dim = call.arg("dim", 0) % len(out)
    labels = fresh(len(out))
    operands = tuple(
        tuple(f"{labels[d]}{i}" if d == dim else labels[d] for d in range(len(out)))
        if len(s) == len(out)
        else None
        for i, s in enumerate(call.shapes)
    )
    whole = frozenset(f"{labels[dim]}{i}" for i in range(len(call.shapes))) | {labels[dim]}
    every = frozenset(range(len(call.shapes)))
    return DimSpec(operands, (tuple(labels),), whole=whole, linear=every, additive=every)


@rule(aten.stack.default)
def stack(call: OpCall) -> DimSpec:
    out = call.out_shapes[0]
    dim = call.arg("dim", 0) % len(out)
    labels = fresh(len(out))
    operand = tuple(lab for d, lab in enumerate(labels) if d != dim)
    every = frozenset(range(len(call.shapes)))
    return DimSpec(
        tuple(operand for _ in call.shapes),
        (tuple(labels),),
        whole=frozenset(labels[dim]),
        linear=every,
        additive=every,
    )


@rule(aten.pad.default, aten.constant_pad_nd.default)
def pad(call: OpCall) -> DimSpec:
    # padded dims stay whole; padding with a non-zero constant is not linear
    src = call.shapes[0]
    amounts = call.arg("pad")
    padded = {len(src) - 1 - i // 2 for i, a in enumerate(amounts) if a}
    spec = _keep_but(call, padded)
    value = call.arg("value", 0) or 0
    mode = call.arg("mode", "constant")
    linear = LINEAR if mode == "constant" and value == 0 else frozenset()
    return DimSpec(spec.operands, spec.outputs, whole=spec.whole, linear=linear, flops=math.prod(src))


@rule(aten.view_as_complex.default, aten.view_as_real.default)
def complex_pairs(call: OpCall) -> DimSpec:
    # a complex number is the pair of reals in the last dim of the real side: that pair stays
    # whole, every other dim is the same dim on both sides (rotary embeddings as complex numbers)
    src, dst = call.shapes[0], call.out_shapes[0]
    labels = fresh(max(len(src), len(dst)))
    shared, pair = tuple(labels[:-1]), labels[-1]
    real, complex_ = (*shared, pair), shared
    operand, out = (real, complex_) if len(src) > len(dst) else (complex_, real)
    return DimSpec((operand,), (out,), whole=frozenset({pair}), linear=LINEAR)
