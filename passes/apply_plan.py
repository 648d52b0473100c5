"""Attach the plan's layouts to the captured graph, checking the plan fits the model.

Reads: ``ctx.plan.nodes`` (matched by node name) and, under a pipeline,
``ctx.plan.pipeline.node_stages``. Writes: ``node.meta["autopar.layouts"]`` (operand
and output layouts), ``node.meta["autopar.grads"]`` (gradient layout of each operand)
and, under a pipeline, ``node.meta["autopar.stage"]`` on every placeholder and op the
plan decided.
"""

from __future__ import annotations

import torch

from autopar.ir.errors import PlanError
from autopar.ir.meta import STAGE, module_path, write_layouts
from autopar.passes.context import PassContext


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    decisions = {d.name: d for d in ctx.plan.nodes}
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        op = str(node.target) if node.op == "call_function" else "placeholder"
        decision = decisions.get(node.name)
        if decision is None:
            if isinstance(node.meta.get("val"), torch.Tensor):
                raise PlanError(
                    f"the plan decides nothing for node {node.name} ({op}); it was made for another model "
                    "or other input shapes: plan again with this model and these example inputs"
                )
            continue
        module = module_path(node) if node.op == "call_function" else decision.module
        if (decision.op, decision.module) != (op, module):
            raise PlanError(
                f"node {node.name} is {op} in module '{module}' in the model but {decision.op} in module "
                f"'{decision.module}' in the plan; the plan was made for another model: plan again"
            )
        seen.add(node.name)
        write_layouts(node, decision.layouts())
        if ctx.plan.pipeline is not None:
            node.meta[STAGE] = ctx.plan.pipeline.node_stages[node.name]
    missing = sorted(set(decisions) - seen)
    if missing:
        raise PlanError(
            f"the plan decides {len(missing)} nodes the model does not have (e.g. {missing[0]}); "
            "the plan was made for another model: plan again"
        )
    return gm
