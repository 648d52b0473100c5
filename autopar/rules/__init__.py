"""Op sharding rules: a table from ATen op to an einsum-like dimension map.

Each rule is a few lines that label the dimensions of an op's tensor operands and
outputs (a :class:`DimSpec`), in the spirit of einsum: ``mm`` is ``mk,kn->mn``.
Everything else follows from the labels:

* sharding a label that appears in the output on a mesh axis splits every tensor
  carrying it (``Shard(d)``) and replicates the tensors that lack it;
* sharding a *summed* label (``k`` of ``mm``) leaves each rank a partial sum, so the
  output is ``Partial`` and *additive* operands lacking the label (a bias) must be
  ``Partial`` too;
* *whole* labels (a softmax dimension, a reshaped-away dimension) are never split;
* a summed label in ``max_over`` leaves each rank a partial *maximum* (``Partial("max")``);
* a label in ``parts`` is a dimension made of equal parts that the op's outputs take one
  each (``split``, ``chunk``, a slice of one part): it splits only as a *strided* shard,
  each rank holding its piece of every part (:mod:`autopar.ir.strided`), and each output
  part is then split plainly. Any other label may split strided too where a strategy asks
  (fused projections whose output is so split; ``enumerate_strategies``'s ``parts``), except
  indexed and counted labels;
* an *indexed* label is a dimension looked up by the values of an index operand (the
  vocabulary of an embedding, the classes a loss gathers): split, each rank looks up the
  indices that fall in its block (shifted, the others masked to zero), so the output is a
  partial sum (``passes/localize_lookups.py`` writes the shift and the mask);
* an op that is *linear* in an operand passes a ``Partial`` operand straight through.

The gradient an operand receives has its own layout: ``Shard`` where the operand
is sharded, ``Partial`` on axes where the op is split but the operand is not (the
classic "all-reduce in backward"), ``Replicate`` otherwise. This is how the
forward choice implies the backward collectives.

Rules live in one module per op family (imported at the end of this module) and register
with :func:`rule`. An op with no rule, or whose rule returns None for a call form it does not
cover, is replicated by :func:`fallback` and reported by the planner; a rule that raises is a
bug, which :func:`spec_of` raises as a :class:`RuleError`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from torch.distributed.tensor import Partial, Replicate

from autopar.ir.layout import Layout, every_rank_holds_a_row, is_uneven, piece_size, splits_unevenly
from autopar.ir.mesh import AxisGroups, MeshSpec, grouped_product
from autopar.ir.meta import module_path
from autopar.ir.strided import is_split, parts_of, strided
from autopar.rules.op_call import OpCall
from autopar.rules.op_call import shape_of as shape_of  # re-exported: rules and planners use it

Labels = tuple[str | None, ...]

#: Marker for a mesh axis on which a Partial operand passes through a linear op.
PASSTHROUGH = "<partial>"


@dataclass(frozen=True)
class DimSpec:
    """How one op call maps the dimensions of its operands to its outputs.

    ``operands[i]`` labels the dimensions of tensor operand ``i`` (operands are the
    op's tensor arguments in argument order, lists flattened); ``None`` marks a
    dimension that is never split (a broadcast or size-1 dimension), and a ``None``
    in place of the whole tuple marks an operand read only for its dtype or shape
    (any layout will do). ``mean_over`` are summed labels whose local result is a
    mean: a rank holding 1/c of such a dimension must scale its result by 1/c so the
    pieces add up (the lowering does this). ``extents`` are further sizes a label's split
    count must divide, and ``counts`` name arguments counting items of a label, which each
    rank passes as its share (a grouped convolution splits its channels only by whole
    groups, and each rank convolves ``groups / c`` of them). ``flops`` (the forward's arithmetic)
    and ``transcendentals`` (the values of exp, log, erf and their kind that its forward and its
    backward compute, which run far below a product's rate) price it (``autopar.planning.cost.model``);
    ``function`` names the elementwise function it evaluates once per output element (``flops``
    of them) where ``autopar calibrate`` times that function
    (:data:`~autopar.rules.elementwise.TIMED_FUNCTIONS`): a calibrated rate then prices it.
    ``attention`` marks a fused attention kernel, ``(scores, causal length)`` (query-key pairs; the
    sequence's length under the implicit causal mask, else 0), which the cluster's calibrated
    attention rates price where it has them (:class:`~autopar.planning.cost.cluster.AttentionRates`).
    """

    operands: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    summed: frozenset[str] = frozenset()
    whole: frozenset[str] = frozenset()
    additive: frozenset[int] = frozenset()
    linear: frozenset[int] = frozenset()
    mean_over: frozenset[str] = frozenset()
    flops: float = 0.0
    transcendentals: tuple[float, float] = (0.0, 0.0)
    extents: tuple[tuple[str, int], ...] = ()
    counts: tuple[tuple[str, str], ...] = ()
    max_over: frozenset[str] = frozenset()
    indexed: tuple[tuple[str, int], ...] = ()
    parts: tuple[tuple[str, int], ...] = ()
    function: str | None = None
    attention: tuple[float, int] | None = None

    def stridable(self, label: str) -> bool:
        """Whether ``label`` may split as a strided shard (not a looked-up or counted one)."""
        return all(label != lab for lab, _ in (*self.indexed, *self.counts))

    def shardable(self) -> tuple[str, ...]:
        """Labels a mesh axis may split, in order of first appearance."""
        out_labels = {lab for labels in self.outputs for lab in labels if lab}
        seen: dict[str, None] = {}
        for labels in (*self.operands, *self.outputs):
            for lab in labels or ():
                if lab and lab not in self.whole and (lab in out_labels or lab in self.summed):
                    seen.setdefault(lab, None)
        return tuple(seen)


class Strided(NamedTuple):
    """A strategy's choice of ``label`` split as a strided shard of ``parts`` parts."""

    label: str
    parts: int


Choice = str | Strided | None


def label_of(choice: Choice) -> str | None:
    """The label a choice splits (:data:`PASSTHROUGH` for a Partial passing through)."""
    return choice.label if isinstance(choice, Strided) else choice


@dataclass(frozen=True)
class Strategy:
    """One way to run an op: the layouts it needs, produces, and hands back in backward.

    ``choices[a]`` is the label split on mesh axis ``a`` (``None`` = not split,
    :data:`PASSTHROUGH` = a Partial operand passes through). ``split`` is how many
    ways the op's work is divided, used for its compute cost (by the largest piece, where a
    label splits unevenly: 10 rows over 4 ranks count as 10/3 ways).
    """

    operands: tuple[Layout | None, ...]
    outputs: tuple[Layout, ...]
    grads: tuple[Layout | None, ...]
    choices: tuple[Choice, ...]
    split: float


#: A rule labels one call of its op, or returns None for a call form it does not cover (the op
#: is then replicated and listed, as one without a rule), checked by a guard at its top: a rule
#: never raises (:func:`spec_of` raises a :class:`RuleError` where one does).
RuleFn = Callable[[OpCall], DimSpec | None]


@dataclass(frozen=True)
class Rule:
    fn: RuleFn
    anchor: bool  # heavy op: gets a solver variable; other ops follow an operand
    family: str


RULES: dict[object, Rule] = {}


def rule(*targets: object, anchor: bool = False) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the rule of every op in ``targets``."""

    def register(fn: RuleFn) -> RuleFn:
        family = fn.__module__.rsplit(".", 1)[-1]
        for t in targets:
            RULES[t] = Rule(fn, anchor, family)
        return fn

    return register


def lookup(target: object) -> Rule | None:
    """The rule for an op overload (falling back to its overload packet, then to its name:
    a rule for another library's op registers under the name, ``"lib.op.overload"``, so
    that the table needs no import of that library)."""
    found = RULES.get(target)
    if found is None and hasattr(target, "overloadpacket"):
        found = RULES.get(target.overloadpacket)
    return found or RULES.get(str(target))


class RuleError(RuntimeError):
    """A sharding rule raised on an op call: a bug of autopar's rule, not of the model, so not an
    :class:`~autopar.ir.errors.AutoparError` (those refuse a user's input on purpose, and callers
    such as the fuzz bench count them as refusals). The rule's own error is its ``__cause__``."""


def spec_of(call: OpCall) -> DimSpec | None:
    """The labels of ``call`` from its op's rule; None where no rule covers the call (its op has
    no rule, or the rule returns None for this call form).

    Args:
        call: the op call to label.

    Raises:
        RuleError: the rule raised, naming the op, the node, its module, its operands' shapes and
            the rule's function.
    """
    found = lookup(call.node.target)
    if found is None:
        return None
    try:
        return found.fn(call)
    except Exception as e:
        rule_fn = f"{found.fn.__module__}.{found.fn.__qualname__}"
        raise RuleError(
            f"the sharding rule {rule_fn} of {call.node.target} raised {type(e).__name__}: {e}, on node "
            f"'{call.node.name}' (module '{module_path(call.node) or '<root>'}', operand shapes "
            f"{[list(s) for s in call.shapes]}): a bug of the rule, which must return None for a call "
            "form it does not cover"
        ) from e


def split_counts(
    spec: DimSpec, operand_layouts: Sequence[Layout | None], mesh_sizes: Sequence[int]
) -> dict[str, int]:
    """How many ways each label of ``spec`` is split when its operands have these layouts."""
    counts: dict[str, int] = {}
    for a, size in enumerate(mesh_sizes):
        for labels, layout in zip(spec.operands, operand_layouts):
            p = None if labels is None or layout is None else layout[a]
            if is_split(p) and labels[p.dim]:
                counts[labels[p.dim]] = counts.get(labels[p.dim], 1) * size
                break
    return counts


class SplitLookup(NamedTuple):
    """An indexed label a strategy splits (:func:`split_lookups`)."""

    table: int  # the operand holding the looked-up dim
    dim: int  # that dim
    index: int  # the operand holding the indices
    axes: tuple[int, ...]  # the mesh axes splitting the dim, outer first


def split_lookups(spec: DimSpec, operand_layouts: Sequence[Layout | None]) -> list[SplitLookup]:
    """The indexed labels of ``spec`` whose dims these operand layouts split."""
    found = []
    for label, index in spec.indexed:
        table = next(i for i, labels in enumerate(spec.operands) if labels and label in labels)
        dim = spec.operands[table].index(label)
        layout = operand_layouts[table] or ()
        axes = tuple(a for a, p in enumerate(layout) if is_split(p) and p.dim == dim)
        if axes:
            found.append(SplitLookup(table, dim, index, axes))
    return found


def fallback(call: OpCall) -> DimSpec:
    """Replicate everything: the rule of an op nobody described."""
    return DimSpec(
        tuple((None,) * len(s) for s in call.shapes), tuple((None,) * len(s) for s in call.out_shapes)
    )


def fresh(n: int, taken: str = "") -> str:
    """``n`` labels not in ``taken``."""
    pool = (c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in taken)
    return "".join(itertools.islice(pool, n))


def broadcast(
    shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...]
) -> tuple[tuple[Labels, ...], Labels]:
    """Labels for operands broadcast together into ``out_shape`` (right-aligned).

    A dimension of size 1 that broadcasts against a larger one gets ``None``.
    """
    out = fresh(len(out_shape))
    labels = []
    for shape in shapes:
        offset = len(out_shape) - len(shape)
        labels.append(
            tuple(out[offset + i] if size == out_shape[offset + i] else None for i, size in enumerate(shape))
        )
    return tuple(labels), tuple(out)


# --- enumeration ----------------------------------------------------------------


def _dims_of(spec: DimSpec, shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]):
    sizes: dict[str, list[int]] = {}
    for labels, shape in zip((*spec.operands, *spec.outputs), (*shapes, *out_shapes)):
        for lab, size in zip(labels or (), shape):
            if lab:
                sizes.setdefault(lab, []).append(size)
    for lab, size in spec.extents:
        sizes.setdefault(lab, []).append(size)
    return sizes


def _divisible(
    choices: Sequence[Choice], mesh: MeshSpec, sizes: dict[str, list[int]], spec: DimSpec | None = None
) -> bool:
    """Every split dim divides evenly (each part of a strided one), and no strided label is
    split over a second axis. Given ``spec``, a label may also split unevenly where
    :func:`_splits_unevenly` allows it."""
    counts: dict[str, int] = {}
    for choice, n in zip(choices, mesh.axis_sizes):
        lab = label_of(choice)
        if lab and lab != PASSTHROUGH:
            counts[lab] = counts.get(lab, 1) * n
    for choice in choices:
        if isinstance(choice, Strided):
            if sum(label_of(c) == choice.label for c in choices) > 1:
                return False
            counts[choice.label] *= choice.parts
    return all(
        all(s % c == 0 for s in sizes[lab]) or _splits_unevenly(spec, lab, choices, sizes[lab], c)
        for lab, c in counts.items()
    )


def _splits_unevenly(
    spec: DimSpec | None, label: str, choices: Sequence[Choice], sizes: list[int], n: int
) -> bool:
    """Whether ``label`` may split unevenly, as DTensor does (``autopar.ir.layout.piece_size``):
    plainly, over one axis, every dim carrying it of one size; not a mean's items (a rank's share
    of the count would differ), nor a dim with extents, counts or parts (a grouped convolution's
    groups, a fused projection's q, k and v). Where the last ranks' pieces are empty (25 heads
    over 8), not a looked-up dim nor a partial maximum's (an empty piece has no row to read and no
    maximum)."""
    if spec is None or choices.count(label) != 1 or len(set(sizes)) != 1:
        return False
    fixed = spec.mean_over | {lab for lab, _ in (*spec.extents, *spec.counts, *spec.parts)}
    if not every_rank_holds_a_row(sizes[0], n):
        fixed |= spec.max_over | {lab for lab, _ in spec.indexed}
    return label not in fixed and splits_unevenly(sizes[0], n)


def _work_split(choices: Sequence[Choice], mesh: MeshSpec, sizes: dict[str, list[int]]) -> float:
    """How many ways the op's work divides, by its largest piece."""
    split = 1.0
    for choice, n in zip(choices, mesh.axis_sizes):
        lab = label_of(choice)
        if lab and lab != PASSTHROUGH:
            size = sizes[lab][0]
            split *= size / piece_size(size, n) if is_uneven(size, n) and choices.count(lab) == 1 else n
    return split


def build(
    spec: DimSpec, choices: Sequence[Choice], mesh: MeshSpec, passthrough: int | None = None
) -> Strategy:
    """The strategy that splits label ``choices[a]`` on mesh axis ``a``.

    A label chosen on several axes gives ``Shard(d)`` on each of them: its dims are split
    over those axes, outer axis first, and the op's work ``split`` by the product.
    """
    n_ops = len(spec.operands)
    operands: list[list] = [[] for _ in range(n_ops)]
    grads: list[list] = [[] for _ in range(n_ops)]
    outputs: list[list] = [[] for _ in spec.outputs]
    split = 1
    whole_parts = dict(spec.parts)
    for choice, size in zip(choices, mesh.axis_sizes):
        lab, k = (choice.label, choice.parts) if isinstance(choice, Strided) else (choice, 1)
        if lab is None:
            for lst in (*operands, *grads, *outputs):
                lst.append(Replicate())
            continue
        if lab == PASSTHROUGH:
            assert passthrough is not None
            additive = passthrough in spec.additive
            for i in range(n_ops):
                partial = i == passthrough or (additive and i in spec.additive)
                operands[i].append(Partial() if partial else Replicate())
                grads[i].append(Replicate() if partial else Partial())
            for o in outputs:
                o.append(Partial())
            continue
        split *= size
        for i, labels in enumerate(spec.operands):
            if labels and lab in labels:
                operands[i].append(strided(labels.index(lab), k))
                grads[i].append(strided(labels.index(lab), k))
            elif lab in spec.summed and i in spec.additive:
                operands[i].append(Partial())
                grads[i].append(Replicate())
            else:
                operands[i].append(Replicate())
                grads[i].append(Partial())
        for o, labels in zip(outputs, spec.outputs):
            if lab in labels:  # an output part of a dim made of parts is split plainly
                o.append(strided(labels.index(lab), 1 if lab in whole_parts else k))
            elif lab in spec.summed:
                o.append(Partial("max") if lab in spec.max_over else Partial())
            else:
                o.append(Replicate())
    free = [labels is None for labels in spec.operands]
    return Strategy(
        operands=tuple(None if f else tuple(o) for f, o in zip(free, operands)),
        outputs=tuple(map(tuple, outputs)),
        grads=tuple(None if f else tuple(g) for f, g in zip(free, grads)),
        choices=tuple(choices),
        split=split,
    )


def enumerate_strategies(
    spec: DimSpec,
    shapes: Sequence[tuple[int, ...]],
    out_shapes: Sequence[tuple[int, ...]],
    mesh: MeshSpec,
    parts: Collection[tuple[int, int]] = (),
    groups: AxisGroups | None = None,
) -> list[Strategy]:
    """Every strategy of an anchor op: one shardable label (or none) per mesh axis, evenly divisible.

    A label may go on several axes: its dims are then split over all of them (outer axis
    first, as DTensor does), into the product of their sizes, which must divide them.
    ``parts`` are ``(size, k)`` pairs: a label whose dims have that size may also split as a
    strided shard of ``k`` parts (on one axis), as a fused projection whose output some op
    cuts into ``k`` parts must. The axes of one of ``groups`` take one label together."""
    sizes = _dims_of(spec, shapes, out_shapes)
    whole_parts = dict(spec.parts)
    options: list[Choice] = [None]
    for lab in spec.shardable():
        if lab in whole_parts:
            options.append(Strided(lab, whole_parts[lab]))
            continue
        options.append(lab)
        if spec.stridable(lab):
            options += [Strided(lab, k) for size, k in parts if set(sizes[lab]) == {size}]
    return [
        _priced(build(spec, choices, mesh), choices, mesh, sizes)
        for choices in grouped_product(options, mesh, groups)
        if _divisible(choices, mesh, sizes, spec)
    ]


def _priced(
    strategy: Strategy, choices: Sequence[Choice], mesh: MeshSpec, sizes: dict[str, list[int]]
) -> Strategy:
    return replace(strategy, split=_work_split(choices, mesh, sizes))


def _follow_split(spec: DimSpec, label: str, parts: int) -> Choice:
    """The choice carrying a split of ``label`` in ``parts`` parts through ``spec``'s op, if any."""
    required = dict(spec.parts).get(label, 1)
    if parts == required:
        return label if parts == 1 else Strided(label, parts)
    return Strided(label, parts) if required == 1 and spec.stridable(label) else None


def follow(
    spec: DimSpec,
    operand: int,
    layout: Layout,
    shapes: Sequence[tuple[int, ...]],
    out_shapes: Sequence[tuple[int, ...]],
    mesh: MeshSpec,
) -> Strategy:
    """The strategy of a cheap op that keeps operand ``operand``'s ``layout`` where it can.

    Axes where the operand's split cannot carry through (a whole dimension, a Partial
    into a non-linear op or a partial maximum into any op, an uneven split) fall back to
    not splitting there.
    """
    shardable = set(spec.shardable())
    labels = spec.operands[operand] or (None,) * len(shapes[operand])
    choices: list[Choice] = []
    for p in layout:
        if is_split(p) and labels[p.dim] in shardable:
            choices.append(_follow_split(spec, labels[p.dim], parts_of(p)))
        elif isinstance(p, Partial) and p.reduce_op == "sum" and operand in spec.linear:
            choices.append(PASSTHROUGH)
        else:
            choices.append(None)
    sizes = _dims_of(spec, shapes, out_shapes)
    for a in reversed(range(len(choices))):
        if not _divisible(choices, mesh, sizes, spec):
            choices[a] = None
    return _priced(build(spec, choices, mesh, passthrough=operand), choices, mesh, sizes)


from autopar.rules import (  # noqa: E402,F401  (registers the table)
    attention,
    conv,
    elementwise,
    embedding,
    factories,
    losses,
    matmul,
    norms,
    pooling,
    reductions,
    routing,
    views,
)
