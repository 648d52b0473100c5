"""A plan as readable text: the report behind :meth:`autopar.ir.plan.Plan.summary`.

Rich tables rendered to plain text (no colours): predictions, the memory plan, the heavy
ops' layouts, every redistribution, the parameters, the solver's statistics, the pipeline
stages and the warnings. The plan's types are needed here for annotations only, so
:mod:`autopar.ir.plan` imports this module and not the other way round.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from autopar.ir.plan import CollectiveStep, MemoryPlan, PipelinePlan, Plan


def render_summary(plan: Plan, width: int) -> str:
    """The report of ``plan`` as text ``width`` characters wide (tables wrap to fit)."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, record=False, color_system=None)
    p = plan.prediction
    console.print(
        f"autopar plan on mesh {plan.mesh_spec} ({plan.cluster['name']}): "
        f"predicted step {p.step_time_s * 1e3:.3f} ms "
        f"(compute {p.compute_s * 1e3:.3f} ms, communication {p.comm_s * 1e3:.3f} ms, "
        f"{_format_bytes(p.comm_bytes)} moved per rank)"
    )
    console.print(
        f"memory per rank: parameters {_format_bytes(p.param_bytes)}, "
        f"gradients {_format_bytes(p.grad_bytes)}, optimizer {_format_bytes(p.optimizer_bytes)}, "
        f"activations {_format_bytes(p.activation_bytes)}, total {_format_bytes(p.memory_bytes)}"
    )
    if plan.memory is not None:
        _print_memory(console, plan.memory)
    if plan.precision is not None:
        console.print(
            f"precision: compute in {plan.precision['param_dtype']} (parameters and floating inputs cast "
            f"where read), master weights, gradients and optimizer state in their own dtype, outputs "
            f"in {plan.precision['output_dtype']}"
        )
    console.print(_operators(plan))
    console.print(_redistributions(plan))
    params = Table(title="parameters")
    params.add_column("parameter")
    params.add_column("layout")
    for fqn, lay in plan.parameters.items():
        params.add_row(fqn, lay)
    console.print(params)
    s = plan.solver
    console.print(
        f"solver: {s.roots} choices ({s.tied_blocks} repeated blocks tied), {s.variables} variables, "
        f"{s.constraints} constraints; capture {s.capture_s:.2f} s, build {s.build_s:.2f} s, "
        f"solve {s.solve_s:.2f} s, gap {s.gap:.2%} ({s.status})"
    )
    if plan.pipeline is not None:
        _print_pipeline(console, plan.pipeline)
    for line in plan.named_layouts.values():
        console.print(f"layout: {line}", soft_wrap=True)
    for w in plan.warnings:
        console.print(f"warning: {w}")
    return buf.getvalue()


def _operators(plan: Plan) -> Table:
    """The nodes whose layouts decide the plan (see ``ChoiceKind.summarised``)."""
    table = Table(title="operators", show_lines=False)
    for col in ("module", "op", "operands", "output", "compute"):
        table.add_column(col)
    for n in plan.nodes:
        if n.kind.summarised:
            operands = ", ".join(o or "-" for o in n.operands)
            table.add_row(
                n.module or "<root>",
                op_label(n.op),
                operands,
                ", ".join(n.outputs),
                _format_seconds(n.compute_s),
            )
    return table


def _redistributions(plan: Plan) -> Table:
    table = Table(title="redistributions")
    for col in ("module", "tensor", "layouts", "forward", "backward", "bytes", "time"):
        table.add_column(col)
    for r in plan.redistributions:
        steps = [*r.forward, *r.backward]
        table.add_row(
            r.module or "<root>",
            f"{r.src}->{r.dst}",
            f"{r.have}->{r.need}",
            _steps(r.forward),
            _steps(r.backward),
            _format_bytes(sum(s.bytes for s in steps)),
            _format_seconds(r.seconds),
        )
    return table


def _print_pipeline(console: Console, pp: PipelinePlan) -> None:
    how = "chosen by the planner" if pp.automatic else "annotated"
    console.print(
        f"pipeline over {pp.axis}={pp.size}: {len(pp.stages)} stages ({how}), schedule {pp.schedule}, "
        f"{pp.microbatches} microbatches; predicted step {pp.step_time_s * 1e3:.3f} ms, "
        f"bubble {pp.bubble_fraction:.1%}"
    )
    table = Table(title="pipeline stages (seconds and bytes per microbatch; gradient sums per step)")
    for col in ("stage", "rank", "modules", "time", "p2p", "grad sums", "parameters", "activations", "peak"):
        table.add_column(col)
    for s in pp.stages:
        shown = ", ".join(s.modules) if len(s.modules) <= 3 else f"{s.modules[0]} … {s.modules[-1]}"
        table.add_row(
            str(s.index),
            str(s.rank),
            shown,
            _format_seconds(s.seconds),
            _format_seconds(s.p2p_seconds),
            _format_seconds(s.grad_sum_seconds),
            _format_bytes(s.param_bytes),
            _format_bytes(s.activation_bytes),
            f"{_format_bytes(s.peak_activation_bytes)} (×{s.in_flight:g})",
        )
    console.print(table)


def _print_memory(console: Console, m: MemoryPlan) -> None:
    how = f"chosen to fit {_format_bytes(m.budget)}" if m.chosen else "as asked"
    budget = f", budget {_format_bytes(m.budget)}" if m.budget is not None and not m.chosen else ""
    recompute = ", ".join(f"{path} ({policy})" for path, policy in m.recompute.items()) or "none"
    offloaded = (("optimizer", m.offload_optimizer), ("activations", m.offload_activations))
    offload = [what for what, on in offloaded if on]
    console.print(
        f"memory plan ({how}{budget}): ZeRO-{m.zero} ({len(m.zero_splits)} parameters split), "
        f"recompute: {recompute}; offload: {', '.join(offload) or 'none'} "
        f"(host {_format_bytes(m.host_optimizer_bytes + m.host_activation_bytes)}); "
        f"activations kept {_format_bytes(m.activation_kept_bytes)}"
    )


def _format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 KiB`` ... ``2.0 TiB`` (TiB is the largest)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # the loop returns at TiB at the latest


def _format_seconds(s: float) -> str:
    """``s`` in µs below a millisecond, else in ms."""
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def op_label(op: str) -> str:
    """A node's op without the ``aten.`` namespace and the ``.default`` overload: ``linear``."""
    return op.removeprefix("aten.").removesuffix(".default")


def step_label(step: CollectiveStep) -> str:
    """One collective of a redistribution as ``all_gather(dp)``: its kind and mesh axes."""
    return f"{step.kind}({','.join(step.mesh_axes)})"


def _steps(steps: tuple[CollectiveStep, ...]) -> str:
    return " + ".join(step_label(s) for s in steps) or "-"
