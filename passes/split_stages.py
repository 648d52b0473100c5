"""Split the per-rank program into pipeline stages (a no-op without a pipeline).

Every planned node carries its stage (``apply_plan`` copies the plan's) and so does
every node inserted for one (a collective runs in its consumer's stage, as the plan
prices it). A node inserted for the model's outputs runs in the first stage among its
users', else in its producers' last.

Stage ``s`` becomes a program ``forward(*received, *state) -> tuple(sent)``:
``received`` are the user inputs for stage 0, else what stage ``s - 1`` sends; ``sent``
are the values later stages read (carried through stage ``s`` when only a later stage
needs them), and for the last stage the model's user outputs; ``state`` are the
parameters, buffers and constants the stage reads: a constant buffer several stages read (a
rotary table, which the plan lets them share) is in the state of each. Only tensors cross stages.

Reads: ``autopar.stage``, ``autopar.layouts``, ``val``. Writes: ``autopar.stage`` on
every node; ``ctx.stages``, one :class:`~autopar.runtime.pipeline_runtime.StageProgram` per
stage (the runtime's type: the pipeline runtime runs them).
"""

from __future__ import annotations

import torch
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree

from autopar.capture.export import gradient_flow
from autopar.ir.errors import CompileError
from autopar.ir.layout import local_shape
from autopar.ir.meta import STAGE, output_layout
from autopar.passes.context import PassContext
from autopar.runtime.pipeline_runtime import Boundary, StageProgram

_OPS = ("call_function", "call_module")  # a call_module runs a recompute region


def _stages_of_inserted(graph: torch.fx.Graph) -> None:
    for node in reversed(graph.nodes):  # users first: the first stage among them
        if node.op == "call_function" and STAGE not in node.meta:
            users = [u.meta[STAGE] for u in node.users if STAGE in u.meta]
            if users:
                node.meta[STAGE] = min(users)
    for node in graph.nodes:  # no user with a stage (feeding the model's outputs): its producers' last
        if node.op == "call_function" and STAGE not in node.meta:
            node.meta[STAGE] = max((a.meta.get(STAGE, 0) for a in node.all_input_nodes), default=0)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if ctx.plan.pipeline is None:
        return gm
    graph = gm.graph
    n = len(ctx.plan.pipeline.stages)
    _stages_of_inserted(graph)
    output = next(node for node in graph.nodes if node.op == "output")
    specs = ctx.captured.program.graph_signature.output_specs
    results = [a for a, s in zip(pytree.tree_leaves(output.args), specs) if s.kind == OutputKind.USER_OUTPUT]
    inputs = [node for node in graph.nodes if node.op == "placeholder" and node.name in ctx.captured.inputs]
    flows = gradient_flow(ctx.captured)  # the captured graph is this one, collectives included

    def last_use(node: torch.fx.Node) -> int:
        return max((n - 1 if u is output else u.meta[STAGE] for u in node.users), default=-1)

    def boundary(node: torch.fx.Node) -> Boundary:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise CompileError(
                f"{node.name} ({type(val).__name__}) crosses a pipeline stage boundary; only tensors can"
            )
        shape = local_shape(tuple(val.shape), output_layout(node), ctx.mesh, ctx.coordinates)
        return Boundary(name=node.name, shape=shape, dtype=val.dtype, requires_grad=flows.get(node, False))

    values = [node for node in graph.nodes if node in inputs or (node.op in _OPS and node.users)]
    crossing = [
        [v for v in values if (0 if v in inputs else v.meta[STAGE]) <= s < last_use(v)] for s in range(n - 1)
    ]
    ctx.stages = []
    for s in range(n):
        received = inputs if s == 0 else crossing[s - 1]
        sent = results if s == n - 1 else crossing[s]
        program, state = _program(gm, s, received, sent)
        ctx.stages.append(
            StageProgram(
                index=s,
                program=program,
                received=[boundary(v) for v in received],
                sent=[boundary(v) for v in sent],
                state=state,
            )
        )
    return gm


def _program(
    gm: torch.fx.GraphModule, s: int, received: list[torch.fx.Node], sent: list[torch.fx.Node]
) -> tuple[torch.fx.GraphModule, list[str]]:
    """Stage ``s``'s program and the names of the state placeholders it takes after ``received``."""
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    ops = [node for node in gm.graph.nodes if node.op in _OPS and node.meta[STAGE] == s]
    read = {a for op in ops for a in op.all_input_nodes if a not in received}
    state = [node for node in gm.graph.nodes if node in read and node.op == "placeholder"]
    for node in (*received, *state):
        env[node] = sub.placeholder(node.name)
        env[node].meta = dict(node.meta)
    # submodules of higher-order ops (a no_grad region): every stage that calls one refers to it
    for node in (*(n for n in gm.graph.nodes if n in read and n.op == "get_attr"), *ops):
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[v] for v in sent))
    sub.lint()
    return torch.fx.GraphModule(gm, sub), [node.name for node in state]
