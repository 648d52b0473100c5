"""In-place ops on a program's own temporaries, captured as their out-of-place forms.

Export keeps ``h.add_(b)`` as ``aten.add_.Tensor``. Such an op cannot be offered a
split: the lowering may hand an op a redistributed *copy* of its operand, and writing to
a copy loses the update. Where nothing can tell the difference, :func:`functionalize`
rewrites ``y = x.op_(...)`` as ``y = op(x, ...)`` and points every later use of ``x`` at
``y``; the op then takes the rule of its out-of-place form. That is the same program when

* ``x`` is computed by the program itself: not a placeholder (a parameter, buffer or
  user input, whose update is a side effect the caller sees: BatchNorm's
  ``num_batches_tracked.add_(1)``) nor a constant;
* ``x``'s memory is the program's own: ``x``, or the tensor it is a view of (through
  ``view``, ``flatten``, ``select``, ``split``'s pieces, ``to``, ...: ops whose schema
  says an output may alias an input), is computed by an op whose outputs alias nothing;
* no other view of that memory (the base itself included) made before the op is read
  at or after it (it would see the update), nor is passed to the op (an overlapping
  read): the write is then seen only through ``x``'s later uses, which read ``y``;
* the op writes only its first argument and returns it (schema ``Tensor(a!) self ->
  Tensor(a!)``), an out-of-place overload of the same name without the ``_`` exists,
  takes the same arguments and aliases nothing, and on the traced values it gives the
  same shape, dtype and strides as the in-place op (no type promotion an in-place op
  would have cast away) without sharing memory with another operand (``set_``);
* ``x`` is not itself an output of the program (its output slot is named in the
  program's signature).

A ``copy_``/``fill_`` into a ``slice``/``select`` of a temporary becomes a
``slice_scatter``/``select_scatter`` of it (:func:`_scatter_view_writes`).

Only the graph's own ops are rewritten: a region exported as a submodule (``torch.no_grad``,
whose in-place op must stay invisible to autograd) keeps its ops. Everything else is left
as it was: the planner replicates it and lists it.

The rewritten node keeps its name and metadata; its ``val`` still shares memory with
``x``'s, which is how the memory model reads it: ``x`` is dead once ``y`` exists (every
later use reads ``y``), one buffer as with the in-place op.
"""

from __future__ import annotations

import operator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

aten = torch.ops.aten


def functionalize(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Rewrite the in-place ops of ``gm`` that are provably safe as out-of-place ops (see
    the module docstring), in place, recompiling ``gm``; returns the nodes rewritten."""
    graph = gm.graph
    rewritten = _scatter_view_writes(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        out_of_place = _out_of_place(node.target)
        if out_of_place is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        written = node.args[0]
        base = _base(written)
        if base is None or not _unobserved(base, {written}, node, order):
            continue
        if not _same_result(node, out_of_place):
            continue
        node.target = out_of_place
        for user in [u for u in written.users if order[u] > order[node]]:
            user.replace_input_with(written, node)
        rewritten.append(node)
    if rewritten:
        gm.recompile()
    return rewritten


def _out_of_place(target: object) -> torch._ops.OpOverload | None:
    """The out-of-place twin of an op writing (only) its first argument and returning it."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    result = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    if (
        first is None
        or result is None
        or not (first.is_write and result.is_write and first.before_set == result.before_set)
        or any(a.alias_info is not None for a in schema.arguments[1:])
        or not schema.name.endswith("_")
    ):
        return None
    packet = getattr(getattr(torch.ops, target.namespace), schema.name.split("::")[-1][:-1], None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload):
        return None
    theirs = twin._schema
    if any(a.alias_info is not None for a in (*theirs.arguments, *theirs.returns)):
        return None
    # the written tensor is passed first and by position, whatever its name (dropout_'s
    # ``self`` is dropout's ``input``); the other arguments must match by name too
    signature = [(a.name if i else "", str(a.type), a.kwarg_only) for i, a in enumerate(schema.arguments)]
    if signature != [
        (a.name if i else "", str(a.type), a.kwarg_only) for i, a in enumerate(theirs.arguments)
    ]:
        return None
    return twin


def _aliases_inputs(node: torch.fx.Node) -> bool:
    """Whether an output of ``node`` may share memory with an input (conservative: an op
    without a schema may; ``getitem`` asks the op whose outputs it takes apart)."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        source = node.args[0]
        schema = getattr(source.target, "_schema", None)
        if source.op != "call_function" or schema is None:
            return True
        return any(r.alias_info is not None for r in schema.returns)
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _base(value: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor whose memory ``value`` is (itself, or what it is a view of), if the program
    computes it into memory of its own; None for an input, a constant or an unknown op."""
    while _aliases_inputs(value):
        source = value.args[0] if value.op == "call_function" and value.args else None
        if not isinstance(source, torch.fx.Node):
            return None
        value = source
    return value if isinstance(value.meta.get("val"), torch.Tensor) else None


def _unobserved(
    base: torch.fx.Node, redirected: set[torch.fx.Node], op: torch.fx.Node, order: dict[torch.fx.Node, int]
) -> bool:
    """No view of ``base``'s memory (``base`` included) made before ``op`` is read at or after
    it but those in ``redirected`` (whose later uses will read the rewritten value), and
    none of them is an output of the program."""
    family, seen = [base], {base}
    while family:
        value = family.pop()
        if any(u.op == "output" for u in value.users):
            return False
        for user in value.users:
            if order[user] >= order[op] and value not in redirected:
                return False  # read at (an overlapping operand) or after the write
            if user in seen or order[user] >= order[op] or not _aliases_inputs(user):
                continue
            seen.add(user)
            family.append(user)
    return True


_VIEW_WRITES = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor}
_SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default}


def _scatter_view_writes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """``base[..., s:e].copy_(src)`` and ``base[..., i].fill_(v)`` on a temporary ``base``, as
    ``base' = slice_scatter(base, src, ...)`` / ``select_scatter`` with every later use of
    ``base`` reading ``base'`` (T5's and BART's ``_shift_right``). Only where the write is
    the view's one use, the written values already have the view's shape and dtype, and no
    other view of ``base`` is read after the write."""
    rewritten = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        view = node.args[0] if node.target in _VIEW_WRITES and node.args else None
        if view is None or view.target not in _SCATTERS or node.users or len(view.users) != 1:
            continue
        base = view.args[0]
        if (
            _base(base) is not base
            or base.op != "call_function"
            or not _unobserved(base, {base, view}, node, order)
        ):
            continue
        with graph.inserting_before(node):
            src = _values_like(graph, view, node)
            if src is None:
                continue
            scattered = graph.call_function(
                _SCATTERS[view.target], (base, src, *view.args[1:]), dict(view.kwargs)
            )
        scattered.meta = {
            **node.meta,
            "val": scattered.target(base.meta["val"], src.meta["val"], *view.args[1:]),
        }
        for user in [u for u in base.users if order.get(u, -1) > order[node]]:
            user.replace_input_with(base, scattered)
        graph.erase_node(node)
        graph.erase_node(view)
        rewritten.append(scattered)
    return rewritten


def _values_like(graph: torch.fx.Graph, view: torch.fx.Node, write: torch.fx.Node) -> torch.fx.Node | None:
    """The values ``write`` puts into ``view``, as a tensor shaped like it; None where that
    would need a cast or a broadcast the write does implicitly."""
    target = view.meta["val"]
    if write.target is aten.fill_.Scalar:
        shape, kwargs = list(target.shape), {"dtype": target.dtype, "device": target.device}
        full = graph.call_function(aten.full.default, (shape, write.args[1]), kwargs)
        full.meta = {**write.meta, "val": torch.full_like(target, write.args[1])}
        return full
    value = write.args[1]
    given = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    if not isinstance(given, torch.Tensor) or given.dtype != target.dtype:
        return None
    if write.target is aten.copy_.default:
        return value if given.shape == target.shape else None
    if given.dim() != 0:
        return None
    expanded = graph.call_function(aten.expand.default, (value, list(target.shape)))
    expanded.meta = {**write.meta, "val": given.expand(target.shape)}
    return expanded


def _storages(value: object) -> set[StorageWeakRef]:
    return {
        StorageWeakRef(t.untyped_storage()) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
    }


def _same_result(node: torch.fx.Node, twin: torch._ops.OpOverload) -> bool:
    """Whether ``twin`` on the traced values gives a result like the in-place op's (shape,
    dtype, strides), and the in-place result shares no memory with another operand."""
    before = node.meta.get("val")
    if not isinstance(before, torch.Tensor):
        return False
    others = [a for a in node.all_input_nodes if a is not node.args[0]]
    if _storages(before) & _storages([a.meta.get("val") for a in others]):
        return False
    args, kwargs = pytree.tree_map(
        lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a, (node.args, node.kwargs)
    )
    try:
        after = twin(*args, **kwargs)
        return (
            isinstance(after, torch.Tensor)
            and after.dtype == before.dtype
            and after.shape == before.shape
            and after.stride() == before.stride()
        )
    except Exception:  # noqa: BLE001 - a form the twin does not take, or sizes it cannot compare
        return False
