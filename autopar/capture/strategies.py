"""MindSpore strategy forms and their lowering to layouts.

A *strategy* gives one item per tensor dimension, either as slice counts (MindSpore
form, ``(2, 1)``) or as mesh-axis names (named form, ``("dp", None)``).
:func:`check_strategy_form` checks what needs neither mesh nor shape;
:func:`strategy_axes` picks the mesh axes splitting each dimension; :func:`lower_strategy`
turns a strategy into a :data:`~autopar.ir.layout.Layout`. Every mistake raises
:class:`~autopar.ir.errors.AnnotationError`, its message starting with the caller's
``where``. See ``docs/annotations.md`` for how counts map to mesh axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.errors import AnnotationError
from autopar.ir.layout import REPLICATE, Layout, ManualRows, every_rank_holds_a_row, splits_unevenly
from autopar.ir.mesh import MeshSpec
from autopar.ir.strided import strided


@dataclass(frozen=True)
class Parts:
    """A named strategy item: the dim is made of ``parts`` equal parts (a fused projection's q, k
    and v), each split over mesh axis ``axis``; a rank holds its piece of every part (a strided
    shard, ``S(d)xk``). ``parameter_plan={"c_attn.weight": (None, Parts("tp", 3))}`` splits
    GPT-2's fused attention projection by heads.

    ``parts`` may give the parts' sizes instead, in order: parts of unequal sizes (a grouped-query
    projection's q, k and v, ``Parts("tp", (4096, 1024, 1024))``) are no placement DTensor has, so
    in a ``parameter_plan`` they pin the layout each part's projection computes with (its slice
    of the weight split over ``axis``; ``autopar.capture.fused_parts``), and the solver chooses
    how the whole weight is stored."""

    axis: str
    parts: int | tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...] | None:
        """The parts' sizes where they are given and not all equal (None: ``count`` equal parts)."""
        if isinstance(self.parts, tuple) and len(set(self.parts)) > 1:
            return self.parts
        return None

    @property
    def count(self) -> int:
        """How many parts the dim is made of."""
        return len(self.parts) if isinstance(self.parts, tuple) else self.parts


@dataclass(frozen=True)
class ManualSplit:
    """A named strategy item of a ``parameter_plan`` (MindSpore's ``manual_split``): the dim is
    split over mesh axis ``axis`` with ``rows[c]`` rows on the rank at coordinate ``c``, in
    order. For lookup tables only (an embedding's vocabulary; every use of the parameter must
    look rows up in that dim). ``parameter_plan={"weight": (ManualSplit("tp", (500, 300, 200)),
    None)}`` gives three ranks 500, 300 and 200 rows of a 1000-row table."""

    axis: str
    rows: tuple[int, ...]


AxisNames = str | tuple[str, ...] | Parts | ManualSplit | None
"""One item of a named strategy: an axis, several axes (outer first), an axis splitting equal
parts (:class:`Parts`), an axis splitting given rows (:class:`ManualSplit`), or None (not split)."""

Strategy = tuple[int, ...] | tuple[AxisNames, ...]
"""One item per tensor dimension: all slice counts, or all :data:`AxisNames`."""

Run = tuple[int, ...]  # indices of mesh axes splitting one dim, outer first

_EXAMPLE = "such as (2, 1) or ('dp', None)"


def is_plain_int(item: object) -> bool:
    """True for an ``int`` that is not a ``bool``: the form of slice counts and stage numbers."""
    # bool is an int subclass, but True as a slice count or a stage is surely a mistake.
    return isinstance(item, int) and not isinstance(item, bool)


def _item_axes(item: AxisNames) -> tuple[str, ...]:
    if item is None:
        return ()
    if isinstance(item, Parts | ManualSplit):
        return (item.axis,)
    return (item,) if isinstance(item, str) else item


def check_strategy_form(strategy: object, *, where: str) -> bool:
    """Check what needs neither mesh nor shape; return True for the integer form.

    Catches a non-tuple, items of the wrong type, counts below 1, forms mixed in one
    tuple, and one axis name used twice. An empty tuple (a 0-dim tensor) is named form.
    """
    if not isinstance(strategy, tuple):
        raise AnnotationError(
            f"{where}: a strategy must be a tuple with one item per tensor dimension, "
            f"{_EXAMPLE}; got {strategy!r}"
        )
    for d, item in enumerate(strategy):
        if is_plain_int(item):
            if item < 1:
                raise AnnotationError(
                    f"{where}: dim {d}: slice count {item} must be at least 1 (1 = not split)"
                )
        elif isinstance(item, tuple):
            if not item or not all(isinstance(n, str) for n in item):
                raise AnnotationError(
                    f"{where}: dim {d}: a tuple of mesh axis names must be non-empty and hold only "
                    f"names, got {item!r}"
                )
        elif isinstance(item, Parts):
            parts = item.parts
            sizes = parts if isinstance(parts, tuple) else (1,) * parts if is_plain_int(parts) else ()
            if not isinstance(item.axis, str) or not all(is_plain_int(n) and n > 0 for n in sizes):
                sizes = ()
            if len(sizes) < 2:
                raise AnnotationError(
                    f"{where}: dim {d}: {item!r} needs a mesh axis name and at least 2 parts (a count, "
                    "or the parts' sizes as a tuple of ints >= 1)"
                )
        elif isinstance(item, ManualSplit):
            rows = item.rows
            if not isinstance(item.axis, str) or not isinstance(rows, tuple) or not rows:
                raise AnnotationError(f"{where}: dim {d}: {item!r} needs an axis name and a tuple of rows")
            if not all(is_plain_int(r) and r >= 0 for r in rows):
                raise AnnotationError(
                    f"{where}: dim {d}: the rows of {item!r} must be ints >= 0 (Python ints: not bools, "
                    "floats or numpy integers)"
                )
        elif item is not None and not isinstance(item, str):
            raise AnnotationError(
                f"{where}: dim {d}: {item!r} is none of: a slice count (int >= 1), a mesh axis "
                f"name (str), a tuple of names, Parts(axis, parts), ManualSplit(axis, rows), None"
            )
    manual = [d for d, item in enumerate(strategy) if isinstance(item, ManualSplit)]
    if len(manual) > 1:
        raise AnnotationError(
            f"{where}: dims {manual} are each given a ManualSplit; a table's rows are split in one dim "
            "only (the dim its ids look up): give the other dims an axis name or None"
        )
    counts = [is_plain_int(item) for item in strategy]
    if any(counts) and not all(counts):
        raise AnnotationError(
            f"{where}: strategy {strategy!r} mixes slice counts with axis names; use one form, "
            f"all ints like (2, 1) or all names/None like ('dp', None)"
        )
    if any(counts):
        return True
    seen: dict[str, int] = {}
    for d, item in enumerate(strategy):
        for name in _item_axes(item):
            if name in seen:
                raise AnnotationError(
                    f"{where}: mesh axis {name!r} is used on dim {seen[name]} and dim {d}; "
                    f"an axis can split a tensor only once"
                )
            seen[name] = d
    return False


def _named_axes(strategy: Strategy, mesh: MeshSpec, where: str) -> list[Run]:
    axes = []
    for d, item in enumerate(strategy):
        names = _item_axes(item)
        for name in names:
            if name not in mesh.axis_names:
                raise AnnotationError(
                    f"{where}: dim {d}: unknown mesh axis {name!r}; the mesh has axes {list(mesh.axis_names)}"
                )
        indices = tuple(mesh.axis_names.index(n) for n in names)
        if list(indices) != sorted(indices):
            # DTensor's placements fix the order: the earlier mesh axis is the outer split.
            in_order = tuple(sorted(names, key=mesh.axis_names.index))
            raise AnnotationError(
                f"{where}: dim {d}: axes {names!r} are not in mesh order {list(mesh.axis_names)}; "
                f"the earlier mesh axis always takes the outer split, so write {in_order!r}"
            )
        axes.append(indices)
    return axes


def _runs(count: int, mesh: MeshSpec) -> list[Run]:
    """Runs of consecutive mesh axes, size-1 axes skipped, whose sizes multiply to ``count``."""
    axes = [i for i, s in enumerate(mesh.axis_sizes) if s > 1]
    runs = []
    for start in range(len(axes)):
        product = 1
        for stop in range(start, len(axes)):
            product *= mesh.axis_sizes[axes[stop]]
            if product == count:
                runs.append(tuple(axes[start : stop + 1]))
            if product >= count:
                break
    return runs


def _disjoint_choices(candidates: list[tuple[int, list[Run]]]) -> list[dict[int, Run]]:
    """Every way to give each dim one of its runs with no mesh axis used twice."""
    if not candidates:
        return [{}]
    (dim, runs), rest = candidates[0], candidates[1:]
    choices = []
    for run in runs:
        for tail in _disjoint_choices(rest):
            if not any(set(run) & set(other) for other in tail.values()):
                choices.append({dim: run, **tail})
    return choices


def _as_named(choice: dict[int, Run], ndim: int, mesh: MeshSpec) -> tuple[AxisNames, ...]:
    """The named-form strategy meaning ``choice`` (for messages)."""
    out: list[AxisNames] = []
    for d in range(ndim):
        names = tuple(mesh.axis_names[a] for a in choice.get(d, ()))
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return tuple(out)


def _axes_str(mesh: MeshSpec, axes: Sequence[int]) -> str:
    return ", ".join(f"{mesh.axis_names[a]}={mesh.axis_sizes[a]}" for a in axes)


def _counted_axes(strategy: tuple[int, ...], mesh: MeshSpec, where: str) -> list[Run]:
    total = math.prod(strategy)
    if mesh.size % total:
        raise AnnotationError(
            f"{where}: the counts of {strategy!r} multiply to {total}, which does not divide the "
            f"{mesh.size} devices of mesh {mesh}"
        )
    all_axes = range(mesh.ndim)
    candidates = []
    for d, count in enumerate(strategy):
        if count == 1:
            continue
        runs = _runs(count, mesh)
        if not runs:
            raise AnnotationError(
                f"{where}: count {count} on dim {d} is not expressible on mesh axes "
                f"{_axes_str(mesh, all_axes)}: a count must be the size of one axis or the product "
                f"of consecutive axes; use the named form to pick axes yourself"
            )
        candidates.append((d, runs))
    choices = _disjoint_choices(candidates)
    if not choices:
        options = "; ".join(
            f"dim {d} (count {strategy[d]}) could use only "
            + " or ".join(f"({_axes_str(mesh, run)})" for run in runs)
            for d, runs in candidates
        )
        raise AnnotationError(
            f"{where}: the counts of {strategy!r} cannot be given disjoint axes of mesh {mesh}: {options}"
        )
    if len(choices) > 1:
        options = " or ".join(repr(_as_named(c, len(strategy), mesh)) for c in choices)
        raise AnnotationError(
            f"{where}: strategy {strategy!r} is ambiguous on mesh {mesh}: it could mean {options}; "
            f"write the named form to choose one"
        )
    return [choices[0].get(d, ()) for d in range(len(strategy))]


def strategy_axes(
    strategy: Strategy,
    mesh: MeshSpec,
    *,
    where: str,
    shape: Sequence[int] | None = None,
    manual: bool = False,
) -> list[Run]:
    """Mesh axis indices splitting each dim, outer first; every check but divisibility.

    The rank is checked first when ``shape`` is given, as a wrong rank explains any later error.
    A :class:`ManualSplit` item is accepted with ``manual`` only (a parameter's compute layout).
    ``where`` starts every error message.
    """
    is_counts = check_strategy_form(strategy, where=where)
    if not manual and manual_rows(strategy) is not None:
        raise AnnotationError(
            f"{where}: ManualSplit gives the rows each rank holds of a lookup table, so it belongs in a "
            f"shard(parameter_plan=...) only; split this tensor with an axis name or None"
        )
    if shape is not None and len(strategy) != len(shape):
        raise AnnotationError(
            f"{where}: strategy {strategy!r} has {len(strategy)} items but the tensor has "
            f"{len(shape)} dims (shape {tuple(shape)}); give one item per dimension"
        )
    if is_counts:
        return _counted_axes(strategy, mesh, where)  # type: ignore[arg-type]
    return _named_axes(strategy, mesh, where)


def _what_works(size: int, parts: int, mesh: MeshSpec, uneven: bool) -> str:
    """The single mesh axes a dim of ``size`` rows in ``parts`` parts could split over."""
    even = [f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.axis_sizes) if n > 1 and size % (n * parts) == 0]
    ragged = [
        f"{a}={n}"
        for a, n in zip(mesh.axis_names, mesh.axis_sizes)
        if uneven and parts == 1 and n > 1 and splits_unevenly(size, n) and every_rank_holds_a_row(size, n)
    ]
    options = [f"evenly over {', '.join(even)}"] if even else []
    options += [f"unevenly (DTensor's pieces) over {', '.join(ragged)}"] if ragged else []
    return "it splits " + " or ".join(options) if options else "no mesh axis splits it: leave it whole (None)"


def _check_manual(item: ManualSplit, d: int, size: int, mesh: MeshSpec, where: str) -> None:
    """``item`` gives one row count per rank of its axis and as many rows as dim ``d`` has."""
    n = mesh.axis_sizes[mesh.axis_names.index(item.axis)]
    if len(item.rows) != n:
        raise AnnotationError(
            f"{where}: dim {d}: {item!r} gives {len(item.rows)} row counts, but mesh axis "
            f"{item.axis!r} has {n} ranks; give one count per rank"
        )
    if isinstance(size, int) and sum(item.rows) != size:
        raise AnnotationError(
            f"{where}: dim {d} has {size} rows, but the rows of {item!r} add up to {sum(item.rows)}"
        )


def manual_rows(strategy: Strategy | None) -> ManualRows | None:
    """The dim and rows per rank of ``strategy``'s :class:`ManualSplit` item, if it has one."""
    items = enumerate(strategy or ())
    return next((ManualRows(d, item.rows) for d, item in items if isinstance(item, ManualSplit)), None)


def unequal_parts(strategy: Strategy | None) -> tuple[int, Parts] | None:
    """The dim and item of ``strategy``'s :class:`Parts` of unequal sizes, if it has one."""
    items = enumerate(strategy or ())
    return next(((d, item) for d, item in items if isinstance(item, Parts) and item.sizes), None)


def _check_unequal_parts(item: Parts, d: int, size: int, n: int, manual: bool, where: str) -> None:
    """``item``'s sizes add up to dim ``d`` (of ``size``) and each splits evenly over its axis (of
    ``n`` ranks); such an item is for a parameter's compute layout (``manual``) only."""
    if not manual:
        raise AnnotationError(
            f"{where}: dim {d}: {item!r} gives parts of unequal sizes, which only a parameter_plan takes "
            "(each part's projection computes with its slice split); give equal parts or a count"
        )
    if sum(item.parts) != size:
        raise AnnotationError(
            f"{where}: dim {d} has size {size}, but the parts of {item!r} add up to {sum(item.parts)}"
        )
    uneven = [p for p in item.parts if p % n]
    if uneven:
        raise AnnotationError(
            f"{where}: dim {d}: parts of sizes {uneven} of {item!r} do not split evenly over mesh axis "
            f"{item.axis!r} of {n} ranks"
        )


def lower_strategy(
    strategy: Strategy,
    shape: Sequence[int],
    mesh: MeshSpec,
    *,
    where: str,
    uneven: bool = False,
    manual: bool = False,
) -> Layout:
    """The layout meaning ``strategy`` for a tensor of ``shape`` on ``mesh``.

    Named form: ``Shard(d)`` on every axis named for dim ``d``, ``Replicate()`` on the others (and on a
    named axis of one device, which splits nothing: the layouts are the same tensor, and the plan's is
    the one the solver also reaches for it); the names of one dim must follow mesh order (DTensor:
    earlier axis = outer split). Integer form: each count > 1 goes to the unique set of disjoint runs of
    consecutive mesh axes with that size (see ``docs/annotations.md``). ``where`` starts every error
    message. Symbolic sizes are not checked for divisibility. With ``uneven`` (a parameter's plan), a
    dim split over one axis that does not divide it is split as DTensor does where every rank holds a
    row (``autopar.ir.layout.every_rank_holds_a_row``).
    A :class:`ManualSplit` item (allowed with ``manual``: a parameter's compute layout) lowers
    to ``Shard(d)`` on its axis; its rows are read with :func:`manual_rows`. A :class:`Parts` item
    of unequal sizes (``manual`` too) leaves its dim whole here: each part's slice is laid out
    (:func:`unequal_parts`, ``autopar.capture.fused_parts``).
    """
    layout = [REPLICATE] * mesh.ndim
    for d, axes in enumerate(strategy_axes(strategy, mesh, where=where, shape=shape, manual=manual)):
        if isinstance(strategy[d], ManualSplit):
            _check_manual(strategy[d], d, shape[d], mesh, where)
            layout[axes[0]] = strided(d, 1)
            continue
        if isinstance(strategy[d], Parts) and strategy[d].sizes:  # each part's slice is laid out, not it
            _check_unequal_parts(strategy[d], d, shape[d], mesh.axis_sizes[axes[0]], manual, where)
            continue
        k = strategy[d].count if isinstance(strategy[d], Parts) else 1
        parts = math.prod(mesh.axis_sizes[a] for a in axes) * k
        # A SymInt test would add a guard to the exported graph; leave those to run time.
        static = isinstance(shape[d], int)
        ragged = (
            uneven
            and static
            and len(axes) == 1
            and k == 1
            and splits_unevenly(shape[d], parts)
            and every_rank_holds_a_row(shape[d], parts)
        )
        if static and shape[d] % parts and not ragged:
            what = f"{k} equal parts each split over" if k > 1 else "equal parts over"
            raise AnnotationError(
                f"{where}: dim {d} has size {shape[d]}, which cannot be split into {parts} equal "
                f"parts ({what} mesh axes {_axes_str(mesh, axes)}); {_what_works(shape[d], k, mesh, uneven)}"
            )
        for a in axes:
            if mesh.axis_sizes[a] > 1:  # an axis of one device splits nothing: the dim is whole on it
                layout[a] = strided(d, k)
    return tuple(layout)
