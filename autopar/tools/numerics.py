"""Find where a compiled module's numbers leave the single-device ones.

:func:`first_divergence` runs the original model's graph on one device and this
rank's compiled program side by side on the same global batch, and compares every
value the two share by name: the compiled value must equal this rank's piece of the
single-device value (Partial values are summed, or maxed, over their axes first, which
is a collective: call it on every rank; a lookup into a split dim is compared once
masked). It returns a description of the first value
that differs, or None. Values nothing reads (a tied weight's unused twin placeholder)
and values still holding uninitialised memory (``empty_like`` being filled piece by
piece) are not compared; what is computed from them is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial
from torch.utils import _pytree as pytree

from autopar.capture.export import capture
from autopar.ir.layout import format_layout
from autopar.ir.meta import LAYOUTS, MASKED_BY, MEAN_SPLIT
from autopar.rules.embedding import table_source
from autopar.runtime import collectives
from autopar.runtime.materialize import local_piece
from autopar.runtime.module import DistributedModule

aten = torch.ops.aten
# ops whose values are whatever memory held, and ops writing into part of their first
# operand: a value built by filling uninitialised memory piece by piece holds garbage until
# its last piece, so it is not compared (the values computed from it are)
_UNINITIALISED = {
    aten.empty_like.default,
    aten.empty.memory_format,
    aten.new_empty.default,
    aten.empty_strided.default,
}
_WRITES_INTO = {
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.index_put.default,
    aten.scatter.src,
    aten.scatter.value,
}


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def first_divergence(
    dmodel: DistributedModule,
    model: torch.nn.Module,
    *args: Any,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    **kwargs: Any,
) -> str | None:
    """See the module docstring; ``args``/``kwargs`` are the global batch, the same on every rank."""
    program = capture(model, args, kwargs, dmodel.plan.mesh_spec).program
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    user = iter(pytree.tree_leaves((args, kwargs)))
    flat = [
        state[s.target]
        if s.target in state
        else program.constants.get(s.target, None)
        if s.kind.name != "USER_INPUT"
        else next(user)
        for s in program.graph_signature.input_specs
    ]
    reference = _Recorder(program.graph_module)
    with torch.no_grad():
        reference.run(*flat)
    local_args, local_kwargs = dmodel.shard_inputs(*args, **kwargs)
    compiled = _Recorder(dmodel._program)
    with torch.no_grad():
        compiled.run(*dmodel.program_inputs(local_args, local_kwargs))
    unset: set[torch.fx.Node] = set()
    manual = {  # placeholder -> the rows per rank of its ManualSplit (held padded)
        s.arg.name: dmodel.plan.manual_rows[s.target]
        for s in dmodel._lowered.exported.graph_signature.input_specs
        if s.target in dmodel.plan.manual_rows
    }
    for node in dmodel._program.graph.nodes:
        if node.target in _UNINITIALISED or (node.target in _WRITES_INTO and node.args[0] in unset):
            unset.add(node)
            continue
        want = reference.values.get(node.name)
        # a lookup into a split dim holds a partial sum only once masked (passes/localize_lookups.py)
        got = compiled.values.get(node.meta[MASKED_BY].name if MASKED_BY in node.meta else node.name)
        if (
            not isinstance(want, torch.Tensor)
            or not isinstance(got, torch.Tensor)
            or LAYOUTS not in node.meta
            or not node.users  # read by nothing: a tied weight's unused twin placeholder
        ):
            continue
        layout = node.meta[LAYOUTS][1][0]
        got = got / node.meta.get(MEAN_SPLIT, 1)
        for axis, p in enumerate(layout):
            if isinstance(p, Partial):
                got = got.clone()
                key = dmodel.axis_keys[dmodel.plan.mesh_spec.axis_names[axis]]
                op = dist.ReduceOp.MAX if p.reduce_op == "max" else dist.ReduceOp.SUM
                dist.all_reduce(got, op=op, group=collectives.axis_info(key).group)
        whole = tuple(
            p if not isinstance(p, Partial) else torch.distributed.tensor.Replicate() for p in layout
        )
        expected = local_piece(want, whole, dmodel.device_mesh, manual.get(table_source(node).name))
        if expected.shape != got.shape or not torch.allclose(
            got.to(expected.dtype), expected, atol=atol, rtol=rtol
        ):
            diff = (
                "shape"
                if expected.shape != got.shape
                else f"max |diff| {(got - expected).abs().max().item():.3g}"
            )
            return (
                f"{node.name} = {node.target} ({format_layout(layout)}): expected local shape "
                f"{tuple(expected.shape)}, got {tuple(got.shape)}; {diff}"
            )
    return None
