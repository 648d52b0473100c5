"""Whether a saved plan fits the model ``compile`` is given: its annotations and input shapes.

A plan is made for one model, its annotations and its example inputs; it records the
annotations (``Plan.annotations``: what each ``shard``, ``constrain``, ``pipeline_stage`` and
``recompute`` asked for, in words) and the shapes of the inputs (``Plan.input_shapes``).
``compile(plan=...)`` refuses a plan made otherwise with a :class:`~autopar.ir.errors.PlanError`
that says what differs, before anything is lowered, instead of a failure at the first step
or a plan that silently ignores an annotation added since.
"""

from __future__ import annotations

import torch

from autopar.capture.constraint_op import parse_constraint_spec
from autopar.capture.export import Captured
from autopar.ir.errors import PlanError
from autopar.ir.layout import format_layout
from autopar.ir.ops import LAYOUT_CONSTRAINT
from autopar.ir.plan import Plan


def annotation_record(captured: Captured) -> dict[str, str]:
    """What the model's annotations ask for, one entry per annotated thing, in words."""
    notes = captured.annotations
    record = {}
    for fqn, layout in notes.parameter_layouts.items():
        kind = "parameter_plan" if fqn in notes.compute_layouts else "parameter_storage"
        manual = notes.parameter_rows.get(fqn)
        record[f"{kind} {fqn}"] = format_layout(layout) + (f" in rows {manual.rows}" if manual else "")
    for node in captured.graph.nodes:
        if node.op == "call_function" and str(node.target) == LAYOUT_CONSTRAINT:
            layout, origin = parse_constraint_spec(node.args[1])
            if layout is not None:  # a free one is a choice point the planner adds (block boundaries)
                record[origin] = format_layout(layout)
    record.update({f"pipeline_stage {path or '<root>'}": str(k) for path, k in notes.stages.items()})
    record.update({f"recompute {path or '<root>'}": str(p) for path, p in notes.recompute.items()})
    return record


def input_shapes(captured: Captured) -> dict[str, list[int]]:
    """The shape of every tensor input, by placeholder name."""
    vals = {n.name: n.meta.get("val") for n in captured.graph.nodes if n.op == "placeholder"}
    return {
        name: [int(s) for s in vals[name].shape]
        for name in captured.inputs
        if isinstance(vals[name], torch.Tensor)
    }


def check_plan_fits(plan: Plan, captured: Captured) -> None:
    """Raise a ``PlanError`` naming the first annotations or input shapes that differ from the plan's."""
    have, made = annotation_record(captured), plan.annotations
    differ = sorted(k for k in have.keys() | made.keys() if have.get(k) != made.get(k))
    if differ:
        lines = "; ".join(
            f"{k}: {made.get(k, 'none')} in the plan, {have.get(k, 'none')} now" for k in differ[:4]
        )
        raise PlanError(
            f"the plan was made for other annotations ({lines}); plan again with these annotations, or "
            "compile without plan="
        )
    precision = captured.precision.to_dict() if captured.precision else None
    if precision != plan.precision:
        raise PlanError(
            f"the plan was made for precision {plan.precision or 'as built'}, but the model is captured "
            f"with {precision or 'none'}; plan again, or compile with the plan's precision"
        )
    shapes = input_shapes(captured)
    for name in sorted(shapes.keys() | plan.input_shapes.keys()):
        if shapes.get(name) != plan.input_shapes.get(name):
            raise PlanError(
                f"input {name!r} has shape {shapes.get(name)} but the plan was made for "
                f"{plan.input_shapes.get(name)}; plan again with these example inputs, or compile "
                "without plan="
            )
