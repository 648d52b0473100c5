"""Megatron's layouts by name: what a plan splits by vocabulary, as strided parts, or unevenly.

A layout string (``S(0)``) says which dim a mesh axis splits; these lines say what that
means for the op (``Plan.named_layouts``, keyed by node name; shown by ``Plan.summary()``,
``autopar explain``, ``autopar show`` and ``autopar viz``):

* **vocab-parallel**: a lookup (an embedding, the loss's pick of its target's logit) whose
  looked-up dim is split: each rank looks up its own rows, the rest masked to zero;
* **strided**: a parameter whose dim holds equal parts (q, k and v), each split alike;
* **uneven**: a parameter whose dim an axis does not divide, in DTensor's pieces;
* **manual**: a lookup table split in the rows per rank its ``ManualSplit`` gives.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from autopar.capture.export import Captured
from autopar.ir.layout import is_uneven, pieces_of
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import NodeLayouts, module_path
from autopar.ir.strided import is_split, parts_of
from autopar.rules import OpCall, shape_of, spec_of, split_lookups
from autopar.rules.embedding import table_source


def named_layouts(
    captured: Captured, layouts: Mapping[torch.fx.Node, NodeLayouts], mesh: MeshSpec
) -> dict[str, str]:
    """One line per node whose layout has a name (module docstring), in graph order."""
    out = {}
    for node, laid in layouts.items():
        if node.op == "placeholder":
            fqn = captured.params.get(node.name) or captured.buffers.get(node.name)
            manual = captured.annotations.parameter_rows.get(fqn)
            line = fqn and _stored(fqn, shape_of(node), laid.output, mesh, manual and manual.rows)
        elif node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            line = _lookup(node, laid, mesh, captured)
        else:
            line = None
        if line:
            out[node.name] = line
    return out


def _pieces(rows: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in rows)


def _stored(
    fqn: str, shape: tuple[int, ...], layout: tuple, mesh: MeshSpec, rows: tuple[int, ...] | None
) -> str | None:
    for p, axis, n in zip(layout, mesh.axis_names, mesh.axis_sizes):
        if not is_split(p):
            continue
        size = shape[p.dim]
        if rows is not None:
            return (
                f"manual {fqn}: dim {p.dim} ({size}) over {axis} in rows of {_pieces(rows)} (ManualSplit), "
                f"each held padded to {max(rows)} rows"
            )
        if parts_of(p) > 1:
            k = parts_of(p)
            return (
                f"strided {fqn}: dim {p.dim} ({size}) holds {k} equal parts, each split over {axis}; "
                f"a rank holds its {size // k // n} of each"
            )
        if is_uneven(size, n):
            pieces = _pieces(pieces_of(size, n))
            return f"uneven {fqn}: dim {p.dim} ({size}) over {axis} in pieces of {pieces}"
    return None


def _lookup(node: torch.fx.Node, laid: NodeLayouts, mesh: MeshSpec, captured: Captured) -> str | None:
    call = OpCall.of(node)
    spec = spec_of(call)
    for lookup in split_lookups(spec, laid.operands) if spec else ():
        size, table = call.shapes[lookup.table][lookup.dim], call.operands[lookup.table].name
        name = captured.params.get(table_source(call.operands[lookup.table]).name, table)
        names = " x ".join(mesh.axis_names[a] for a in lookup.axes)
        n = mesh.axis_sizes[lookup.axes[0]]
        manual = captured.annotations.parameter_rows.get(name)
        pieces = f", rows of {_pieces(manual.rows)}" if manual else ""
        if manual is None and len(lookup.axes) == 1 and is_uneven(size, n):
            pieces = f", pieces of {_pieces(pieces_of(size, n))}"
        return (
            f"vocab-parallel {str(node.target).split('.')[1]} in '{module_path(node) or '<root>'}': "
            f"{name} dim {lookup.dim} ({size}) split over {names}{pieces}; "
            "each rank looks up its rows, the rest masked: partial sums"
        )
    return None
