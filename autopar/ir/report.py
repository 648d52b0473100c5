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

#: The consumer a parameter's gradient sum is recorded with (``Redistribution.dst``).
GRADIENT_SUM = "<gradient sum>"

if TYPE_CHECKING:
    from autopar.ir.plan import CollectiveStep, MemoryPlan, PipelinePlan, Plan


LEGEND = (
    "layouts: one placement per mesh axis, in the mesh's order: R whole on every rank, S(d) split "
    "along dim d (S(d)xk: each of k equal parts split), P partial sums (a sum over the axis is "
    "pending), P(max) partial maxima"
)


def _mesh_candidates(plan: Plan) -> Table:
    """The meshes searched for a device count, the fastest first, with why each lost."""
    table = Table(title="meshes searched (the device count given)")
    for column in ("mesh", "step lower bound", "predicted step", "memory per device", "outcome"):
        table.add_column(column)
    rows = sorted(plan.mesh_candidates, key=lambda r: r.get("step_s", float("inf")))
    for r in rows:
        step = f"{r['step_s'] * 1e3:.1f} ms" if "step_s" in r else ""
        held = _format_bytes(r["memory_bytes"]) if "memory_bytes" in r else ""
        table.add_row(r["mesh"], f"{r['bound_s'] * 1e3:.1f} ms", step, held, r["outcome"])
    return table


def render_summary(plan: Plan, width: int, verbose: bool = False) -> str:
    """The report of ``plan`` as text ``width`` characters wide (tables wrap to fit); without
    ``verbose``, the layout constraints autopar adds and redistributions moving nothing are
    left out, and gradient sums are one row per kind of collective."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, record=False, color_system=None)
    p = plan.prediction
    step = plan.step_time_s
    # under a pipeline the prediction's seconds are the busiest pipeline rank's whole step (Prediction)
    per = ", the busiest pipeline rank's" if plan.pipeline is not None else ""
    console.print(
        f"autopar plan on mesh {plan.device_mesh_spec} ({plan.cluster['name']}): predicted step "
        f"{step * 1e3:.3f} ms (compute {p.compute_s * 1e3:.3f} ms, communication {p.comm_s * 1e3:.3f} ms"
        f"{per}; {_format_bytes(p.comm_bytes)} moved per rank per step)"
    )
    _print_memory_per_rank(console, plan)
    if plan.accumulation > 1:
        console.print(
            f"gradient accumulation: {plan.accumulation} microbatches per step, each forward and backward "
            f"(activations are one microbatch's), then one gradient sum and one optimizer step"
        )
    if plan.memory is not None:
        _print_memory(console, plan.memory)
    if plan.precision is not None:
        console.print(
            f"precision: compute in {plan.precision['param_dtype']} (parameters and floating inputs cast "
            f"where read), master weights, gradients and optimizer state in their own dtype, outputs "
            f"in {plan.precision['output_dtype']}"
        )
    _print_axes(console, plan)
    console.print(LEGEND)
    console.print(_operators(plan, verbose))
    console.print(_redistributions(plan, verbose))
    params = Table(title="parameters")
    params.add_column("parameter")
    params.add_column("layout")
    for fqn, lay in plan.parameters.items():
        params.add_row(fqn, lay)
    console.print(params)
    s = plan.solver
    if plan.loaded_from is not None:
        console.print(f"plan loaded from {plan.loaded_from}; the solver's line is from when it was made:")
    console.print(
        f"solver: {s.roots} choices ({s.tied_blocks} repeated blocks tied), {s.variables} variables, "
        f"{s.constraints} constraints; capture {s.capture_s:.2f} s, build {s.build_s:.2f} s, "
        f"solve {s.solve_s:.2f} s, gap {s.gap:.2%} ({s.status})"
    )
    if plan.pipeline is not None:
        _print_pipeline(console, plan.pipeline)
    if plan.mesh_candidates:
        console.print(_mesh_candidates(plan))
    if plan.update is not None:
        u = plan.update
        console.print(
            f"update: {u['mode']}: a unit's clock {u['clock_s'] * 1e3:.3f} ms, {u['vs_sync']:.2f}x sync's "
            "samples/s with every replica at the same speed (autopar plan --stragglers compares the "
            "modes under a straggler)",
            soft_wrap=True,
        )
    for line in plan.named_layouts.values():
        console.print(f"layout: {line}", soft_wrap=True)
    for w in plan.warnings:
        console.print(f"warning: {w}")
    return buf.getvalue()


def _print_memory_per_rank(console: Console, plan: Plan) -> None:
    """Memory per rank; under a pipeline, that of the pipeline rank holding the most: all its
    stages, their activations at the rank's peak (every rank's in the pipeline's table)."""
    p = plan.prediction
    if plan.pipeline is None:
        console.print(
            f"memory per rank: parameters {_format_bytes(p.param_bytes)}, "
            f"gradients {_format_bytes(p.grad_bytes)}, optimizer {_format_bytes(p.optimizer_bytes)}, "
            f"activations {_format_bytes(p.activation_bytes)} at their peak, "
            f"total {_format_bytes(p.memory_bytes)}"
        )
        return
    rank = plan.pipeline.largest_rank
    top = plan.pipeline.rank_stages(rank)
    held = [sum(getattr(s, f) for s in top) for f in ("param_bytes", "grad_bytes", "optimizer_bytes")]
    flights = ", ".join(f"{s.in_flight:g} of stage {s.index}" for s in top)
    console.print(
        f"memory per rank, largest on pipeline rank {rank} (stages {', '.join(str(s.index) for s in top)}): "
        f"parameters {_format_bytes(held[0])}, gradients {_format_bytes(held[1])}, optimizer "
        f"{_format_bytes(held[2])}, activations {_format_bytes(sum(s.peak_activation_bytes for s in top))} "
        f"at the rank's peak (microbatches in flight: {flights}), total "
        f"{_format_bytes(plan.pipeline.rank_memory_bytes(rank))}"
    )


def _print_axes(console: Console, plan: Plan) -> None:
    """One line per mesh axis: what it splits and what it moves; why nothing is split, if so."""
    moved: dict[str, int] = {}
    for r in plan.redistributions:
        for step in (*r.forward, *r.backward):
            for axis in step.mesh_axes:
                moved[axis] = moved.get(axis, 0) + step.bytes
    if plan.pipeline is not None:
        pp = plan.pipeline
        console.print(f"axis {pp.axis} ({pp.size}): runs {len(pp.stages)} pipeline stages ({pp.schedule})")
    for name, size in plan.mesh.items():
        role = plan.axis_roles.get(name, "")
        console.print(f"axis {name} ({size}): {role}; moves {_format_bytes(moved.get(name, 0))} per rank")
    if plan.splits_nothing:
        console.print(
            "every op runs whole on every rank: at this size splitting would cost more in "
            "communication than it saves in compute (a larger batch or model changes that)"
        )


def _operators(plan: Plan, verbose: bool) -> Table:
    """The nodes whose layouts decide the plan (see ``ChoiceKind.summarised``); without
    ``verbose``, not what autopar adds: layout constraints at block boundaries, and the casts of
    parameters to the compute dtype under mixed precision."""
    table = Table(title="operators", show_lines=False)
    for col in ("module", "op", "operands", "output", "compute"):
        table.add_column(col, overflow="fold")
    casts = plan.parameter_casts
    for n in plan.nodes:
        added = op_label(n.op) == "autopar.layout_constraint" or n.name in casts
        if n.kind.summarised and (verbose or not added):
            operands = ", ".join(o or "-" for o in n.operands)
            table.add_row(
                n.module or "<root>",
                op_label(n.op),
                operands,
                ", ".join(n.outputs),
                _format_seconds(n.compute_s),
            )
    return table


def _redistributions(plan: Plan, verbose: bool) -> Table:
    """Every redistribution; without ``verbose``, not those moving nothing, and the gradient
    sums one row per kind of collective (how many parameters, their bytes together)."""
    table = Table(title="redistributions (bytes per rank)")
    for col in ("module", "tensor", "layouts", "forward", "backward", "bytes", "time"):
        table.add_column(col, overflow="fold")
    sums: dict[tuple[str, str], list] = {}
    for r in plan.redistributions:
        nbytes = sum(s.bytes for s in (*r.forward, *r.backward))
        name = plan.parameter_nodes.get(r.src, r.src)
        if r.dst == GRADIENT_SUM and not verbose:
            count, total, seconds, names = sums.get((_steps(r.forward), _steps(r.backward)), (0, 0, 0.0, []))
            sums[_steps(r.forward), _steps(r.backward)] = [
                count + 1,
                total + nbytes,
                seconds + r.seconds,
                [*names, name],
            ]
        elif nbytes or verbose:
            tensor = f"{name} (gradient sum)" if r.dst == GRADIENT_SUM else f"{name}->{r.dst}"
            row = (_steps(r.forward), _steps(r.backward), _format_bytes(nbytes), _format_seconds(r.seconds))
            table.add_row(r.module or "<root>", tensor, f"{r.have}->{r.need}", *row)
    for (fwd, bwd), (count, nbytes, seconds, names) in sums.items():
        shown = ", ".join(names[:2]) + (f" ... {names[-1]}" if len(names) > 2 else "")
        row = (fwd, bwd, _format_bytes(nbytes), _format_seconds(seconds))
        table.add_row("gradient sums", f"{count} parameters: {shown}", "", *row)
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
    ranks = Table(title="pipeline ranks (what each holds at its peak: its stages' state and activations)")
    for col in ("rank", "stages", "state", "activations", "total"):
        ranks.add_column(col)
    for r in range(pp.size):
        mine = pp.rank_stages(r)
        state = sum(s.param_bytes + s.grad_bytes + s.optimizer_bytes for s in mine)
        ranks.add_row(
            str(r),
            ", ".join(f"{s.index} (×{s.in_flight:g})" for s in mine),
            _format_bytes(state),
            _format_bytes(sum(s.peak_activation_bytes for s in mine)),
            _format_bytes(pp.rank_memory_bytes(r)),
        )
    console.print(ranks)


def _print_memory(console: Console, m: MemoryPlan) -> None:
    limit = "no budget" if m.budget is None else f"the budget of {format_budget(m.budget)}"
    how = f"ZeRO and recompute chosen to fit {limit}" if m.chosen else f"as given; fits {limit}"
    recompute = ", ".join(f"{path} ({policy})" for path, policy in m.recompute.items()) or "none"
    offloaded = (("optimizer", m.offload_optimizer), ("activations", m.offload_activations))
    offload = [what for what, on in offloaded if on]
    stored = ""
    if m.stored_split:  # the solver's layouts store these split: FSDP-style, not ZeRO's doing
        names = list(m.stored_split)
        shown = ", ".join(names[:2]) + (f" ... {names[-1]}" if len(names) > 2 else "")
        axes = ", ".join(sorted({a for split in m.stored_split.values() for a in split}))
        stored = (
            f"; FSDP-style storage (the solver's layouts): {len(names)} parameters stored split over "
            f"{axes} and gathered where used ({shown}), saving {_format_bytes(m.stored_split_bytes)} per rank"
        )
    console.print(
        f"memory plan ({how}): ZeRO-{m.zero} ({len(m.zero_splits)} parameters split){stored}, "
        f"recompute: {recompute}; offload: {', '.join(offload) or 'none'} "
        f"(host {_format_bytes(m.host_optimizer_bytes + m.host_activation_bytes)}); "
        f"activations kept from forward to backward {_format_bytes(m.activation_kept_bytes)}"
    )


def format_budget(n: float) -> str:
    """A memory budget in the units it was most likely given in: ``80 GB`` (a round number of
    decimal gigabytes), ``64 GiB`` (of binary ones), else with binary units."""
    if n >= 1e9 and round(n / 1e8) * 1e8 == n:
        return f"{n / 1e9:g} GB"
    return _format_bytes(n)


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
