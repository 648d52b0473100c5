"""Lookups into a split dimension look up this rank's block only (vocab-parallel lookups).

An op whose rule marks a label *indexed* (an embedding's vocabulary, the classes a gather
picks from; :class:`autopar.rules.DimSpec`) and whose plan splits that label holds only a
block of the looked-up rows on each rank, while its indices are global. The op then reads

    index' = autopar.block_index(index, axes, starts)    # shifted into the block, else row 0
    out    = where(autopar.in_block(index, ...), op(..., index'), 0)

so each rank contributes the rows it holds and zeros elsewhere: the partial sum the plan's
layout (``Partial`` on those axes) promises. An id outside the whole dim would then look up
zeros where one device raises ``IndexError``: unless ``ctx.check_ids`` is off, the ids first pass
through ``autopar.check_ids`` (``autopar/runtime/lookups.py``), which raises on every rank
together, and the two ops above read its output. The gradient follows: masked rows receive
zero. An embedding's ``padding_idx`` (a row that gets no gradient) is global too; it is
dropped from the op and the padded positions' results are detached instead.

A parameter split by ``ManualSplit`` (``plan.manual_rows``) gives each rank its own number
of rows; the blocks then begin where those rows do.

Reads: ``autopar.layouts``, ``val``, ``autopar.stage``, ``nn_module_stack``;
``plan.manual_rows``, ``ctx.check_ids``. Writes: the index argument of those ops and
``autopar.masked_by`` on them; new ``check_ids``, ``block_index``, ``in_block``, ``where`` (and
for a padding index ``eq``, ``unsqueeze``, ``detach``) nodes with ``autopar.layouts`` and the
op's stage and module.
"""

from __future__ import annotations

import math

import torch

import autopar.runtime.lookups  # noqa: F401  (registers torch.ops.autopar.block_index, in_block, check_ids)
from autopar.ir.errors import CompileError
from autopar.ir.layout import Layout, pieces_of, row_starts
from autopar.ir.meta import MASKED_BY, GraphLayouts, NodeLayouts, module_path, place_beside, write_layouts
from autopar.ir.strided import is_split, parts_of, strided
from autopar.passes.context import PassContext
from autopar.rules import OpCall, SplitLookup, spec_of, split_lookups
from autopar.rules.embedding import table_source

aten = torch.ops.aten
ops = torch.ops.autopar


def _shifted(layout: Layout, by: int) -> Layout:
    return tuple(strided(p.dim + by, parts_of(p)) if is_split(p) else p for p in layout)


class _Inserter:
    """Adds nodes next to ``op`` that share its stage, its module and the user's line that recorded it."""

    def __init__(self, op: torch.fx.Node) -> None:
        self.op = op

    def add(self, target: object, args: tuple, val: torch.Tensor, operands: tuple, output: Layout):
        node = self.op.graph.call_function(target, args)
        node.meta["val"] = val
        place_beside(node, self.op)
        if "stack_trace" in self.op.meta:  # an error the node raises names the user's line
            node.meta["stack_trace"] = self.op.meta["stack_trace"]
        write_layouts(node, NodeLayouts(operands=operands, outputs=(output,)))
        return node


def _row_starts(call: OpCall, lookup: SplitLookup, ctx: PassContext) -> list[int]:
    """Where each rank's rows of the looked-up dim begin: a parameter's ``ManualSplit`` rows
    (``plan.manual_rows``), else DTensor's pieces."""
    table = table_source(call.operands[lookup.table])
    manual = ctx.plan.manual_rows.get(ctx.captured.params.get(table.name, ""))
    if manual is not None:
        return list(row_starts(manual.rows))
    n = math.prod(ctx.mesh.axis_sizes[a] for a in lookup.axes)
    return list(row_starts(pieces_of(call.shapes[lookup.table][lookup.dim], n)))


def _localize(node: torch.fx.Node, layouts: NodeLayouts, ctx: PassContext) -> None:
    call = OpCall.of(node)
    spec = spec_of(call)
    if spec is None:
        return
    for lookup in split_lookups(spec, layouts.operands):
        if any(parts_of(layouts.operands[lookup.table][a]) > 1 for a in lookup.axes):
            raise CompileError(f"{node.name}: a lookup into a strided dimension is not planned")
        keys = ",".join(ctx.axis_keys[ctx.mesh.axis_names[a]] for a in lookup.axes)
        labels = (spec.outputs[0], spec.operands[lookup.index])
        starts = _row_starts(call, lookup, ctx)
        check = _id_check(node, call, lookup, layouts, starts[-1], ctx) if ctx.check_ids else None
        _mask_lookup(node, call, labels, lookup.index, layouts, keys, starts, check)


def _id_check(
    node: torch.fx.Node, call: OpCall, lookup: SplitLookup, layouts: NodeLayouts, size: int, ctx: PassContext
) -> tuple[int, str, str]:
    """``autopar.check_ids``'s arguments but the ids for ``lookup``: the whole dim's size, the keys
    of the axes that split the ids (their ranks hold other ids), and words naming the lookup."""
    index_layout = layouts.operands[lookup.index] or ()
    names = ctx.mesh.axis_names
    keys = ",".join(ctx.axis_keys[names[a]] for a, p in enumerate(index_layout) if is_split(p))
    param = ctx.captured.params.get(table_source(call.operands[lookup.table]).name)
    source = f" of parameter '{param}'" if param else ""
    over = ("mesh axis " if len(lookup.axes) == 1 else "mesh axes ") + ", ".join(
        repr(names[a]) for a in lookup.axes
    )
    op = node.target.overloadpacket.__name__
    where = f"{op} '{node.name}' of module '{module_path(node) or '<root>'}'"
    return size, keys, f"{where} (dim {lookup.dim}{source}, split over {over})"


def _mask_lookup(
    node: torch.fx.Node,
    call: OpCall,
    labels: tuple[tuple, tuple],
    index_slot: int,
    layouts: NodeLayouts,
    keys: str,
    starts: list[int],
    check: tuple[int, str, str] | None,
) -> None:
    """Shift ``node``'s index operand into the block and mask its result (module docstring); the
    ids pass through ``autopar.check_ids`` with the arguments ``check`` first, unless it is None."""
    out_labels, index_labels = labels
    index = call.operands[index_slot]
    index_layout, out_layout = layouts.operands[index_slot], layouts.output
    index_val, out_val = index.meta["val"], node.meta["val"]
    leading = out_labels.index(index_labels[0])
    trailing = len(out_labels) - leading - len(index_labels)
    mask_val = index_val.new_empty(
        (1,) * leading + tuple(index_val.shape) + (1,) * trailing, dtype=torch.bool
    )
    mask_layout = _shifted(index_layout, leading)
    at = _Inserter(node)
    with node.graph.inserting_before(node):
        ids = index
        if check is not None:
            ids = at.add(ops.check_ids.default, (index, *check), index_val, (index_layout,), index_layout)
        shift = (ids, keys, starts)
        local = at.add(ops.block_index.default, shift, index_val, (index_layout,), index_layout)
        in_block = (ids, keys, starts, leading, trailing)
        mask = at.add(ops.in_block.default, in_block, mask_val, (index_layout,), mask_layout)
    node.replace_input_with(index, local)
    # a zero of the looked-up values' dtype: a float zero would promote integer rows to float
    zero = 0.0 if out_val.is_floating_point() else False if out_val.dtype is torch.bool else 0
    with node.graph.inserting_after(node):
        masked = at.add(
            aten.where.ScalarOther, (mask, node, zero), out_val, (mask_layout, out_layout), out_layout
        )
    node.replace_all_uses_with(masked, delete_user_cb=lambda user: user is not masked)
    node.meta[MASKED_BY] = masked
    padding = call.arg("padding_idx", -1) if node.target is aten.embedding.default else -1
    if padding is not None and padding >= 0:
        node.args = (*node.args[:2], -1, *node.args[3:])
        _detach_padding(masked, index, padding, at, (index_layout, out_layout))


def _detach_padding(
    masked: torch.fx.Node, index: torch.fx.Node, padding: int, at: _Inserter, layouts: tuple[Layout, Layout]
) -> None:
    """An embedding's padded positions keep their (looked-up) value but pass no gradient."""
    index_layout, out_layout = layouts
    out_val, index_val = masked.meta["val"], index.meta["val"]
    with masked.graph.inserting_after(masked):
        is_pad = at.add(aten.eq.Scalar, (index, padding), index_val.bool(), (index_layout,), index_layout)
    with masked.graph.inserting_after(is_pad):
        pad = at.add(
            aten.unsqueeze.default, (is_pad, -1), index_val.bool()[..., None], (index_layout,), index_layout
        )
    with masked.graph.inserting_after(pad):
        frozen = at.add(aten.detach.default, (masked,), out_val, (out_layout,), out_layout)
    with masked.graph.inserting_after(frozen):
        where = (pad, frozen, masked)
        out = at.add(aten.where.self, where, out_val, (index_layout, out_layout, out_layout), out_layout)
    masked.replace_all_uses_with(out, delete_user_cb=lambda user: user not in (frozen, out))


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    layouts = GraphLayouts(gm.graph)  # the nodes before this pass: the ones it may rewrite
    for node in list(layouts):
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            _localize(node, layouts[node], ctx)
    return gm
