"""Megatron's layouts by name: what a plan splits by vocabulary, as strided parts, or unevenly.

A layout string (``S(0)``) says which dim a mesh axis splits; these lines say what that
means for the op (``Plan.named_layouts``, keyed by node name; shown by ``Plan.summary()``,
``autopar explain``, ``autopar show`` and ``autopar viz``):

* **vocab-parallel**: a lookup (an embedding, the loss's pick of its target's logit) whose
  looked-up dim is split: each rank looks up its own rows, the rest masked to zero;
* **strided**: a parameter whose dim holds equal parts (q, k and v), each split alike;
* **uneven**: a parameter whose dim an axis does not divide, in DTensor's pieces.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from autopar.capture.export import Captured, module_path
from autopar.ir.layout import is_uneven, piece_size
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import NodeLayouts
from autopar.ir.strided import is_split, parts_of
from autopar.rules import OpCall, shape_of, spec_of, split_lookups


def named_layouts(
    captured: Captured, layouts: Mapping[torch.fx.Node, NodeLayouts], mesh: MeshSpec
) -> dict[str, str]:
    """One line per node whose layout has a name (module docstring), in graph order."""
    out = {}
    for node, laid in layouts.items():
        if node.op == "placeholder":
            fqn = captured.params.get(node.name) or captured.buffers.get(node.name)
            line = fqn and _stored(fqn, shape_of(node), laid.output, mesh)
        elif node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            line = _lookup(node, laid, mesh, captured.params)
        else:
            line = None
        if line:
            out[node.name] = line
    return out


def _pieces(size: int, n: int) -> str:
    return ", ".join(str(piece_size(size, n, c)) for c in range(n))


def _stored(fqn: str, shape: tuple[int, ...], layout: tuple, mesh: MeshSpec) -> str | None:
    for p, axis, n in zip(layout, mesh.axis_names, mesh.axis_sizes):
        if not is_split(p):
            continue
        size = shape[p.dim]
        if parts_of(p) > 1:
            k = parts_of(p)
            return (
                f"strided {fqn}: dim {p.dim} ({size}) holds {k} equal parts, each split over {axis}; "
                f"a rank holds its {size // k // n} of each"
            )
        if is_uneven(size, n):
            return f"uneven {fqn}: dim {p.dim} ({size}) over {axis} in pieces of {_pieces(size, n)}"
    return None


def _lookup(node: torch.fx.Node, laid: NodeLayouts, mesh: MeshSpec, params: Mapping[str, str]) -> str | None:
    call = OpCall.of(node)
    spec = spec_of(call)
    for lookup in split_lookups(spec, laid.operands) if spec else ():
        size, table = call.shapes[lookup.table][lookup.dim], call.operands[lookup.table].name
        names = " x ".join(mesh.axis_names[a] for a in lookup.axes)
        n = mesh.axis_sizes[lookup.axes[0]]
        uneven = f", pieces of {_pieces(size, n)}" if len(lookup.axes) == 1 and is_uneven(size, n) else ""
        return (
            f"vocab-parallel {str(node.target).split('.')[1]} in '{module_path(node) or '<root>'}': "
            f"{params.get(table, table)} dim {lookup.dim} ({size}) split over {names}{uneven}; "
            "each rank looks up its rows, the rest masked: partial sums"
        )
    return None
