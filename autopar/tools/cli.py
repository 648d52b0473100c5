"""The ``autopar`` command line: plan a model, show its per-rank program, report how it scales.

::

    autopar plan MODEL --mesh dp=8,tp=8|--devices 64 [--cluster NAME|FILE] [--budget 80GB] [-o plan.json]
    autopar calibrate [--ranks 2] -o cluster.json   (or: torchrun ... -m autopar.tools.cli calibrate -o F)
    autopar calibrate --device cuda [--links h100] -o cluster.json   (one GPU, links from a preset)
    autopar show MODEL --mesh dp=2,tp=2 | autopar show plan.json
    autopar explain plan.json NODE
    autopar viz MODEL|plan.json -o graph.html|graph.svg|graph.dot
    autopar scaling MODEL --devices 1,2,4,8 [--axis dp] [--plot scaling.png]

``MODEL`` is ``path/to/file.py:factory`` (a function returning ``(model, args)`` or
``(model, args, kwargs)`` of example inputs; ``key=value`` words after it are passed to the
factory) or ``hf:ARCH`` (a transformers architecture built locally from its default
config, ``key=value`` words overriding config fields, e.g. ``hf:gpt2 n_layer=2``; nothing is
downloaded) with ``--batch`` x ``--seq`` token ids and labels. ``hf:`` models are built on
``meta`` (a factory may build on ``meta`` too: ``examples/gpt.py:build device=meta``), so
planning and ``show`` need no memory for weights.

Bad input (a model spec, a mesh string, a cluster name, a budget) prints one line and
exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch

from autopar.ir.options import MixedPrecision
from autopar.planning.cost import update_cost
from autopar.planning.cost.model import get_cluster
from autopar.tools.cli_inputs import (
    USAGE_ERROR,
    UsageError,
    cluster_name,
    load_model,
    parse_bytes,
    parse_counts,
    parse_mesh,
    parse_slowdowns,
    plot_file,
    positive_int,
    samples_per_step,
    width,
    writable,
)
from autopar.tools.scaling import plot_scaling, scaling_table

# --- commands ----------------------------------------------------------------------------


def _plan(a: argparse.Namespace, model: torch.nn.Module, args: tuple, kwargs: dict, mesh: dict) -> Any:
    """Capture, then solve, with a spinner for each on the terminal: ``(captured, plan)``."""
    from rich.console import Console

    from autopar.ir.mesh import MeshSpec
    from autopar.planning.planner import capture_for, plan_captured

    cluster, budget = get_cluster(a.cluster), a.budget
    console = Console(stderr=True)
    spec = MeshSpec.of(mesh)
    t0 = time.perf_counter()
    with console.status(f"capturing {type(model).__name__} with torch.export ..."):
        captured = capture_for(model, args, kwargs, spec, None, _precision(a))
    capture_s = time.perf_counter() - t0
    with console.status(f"solving the strategy ILP for mesh {spec} ..."):
        plan = plan_captured(captured, spec, cluster=cluster, memory_budget=budget, capture_s=capture_s)
        return captured, plan


@contextmanager
def _writing(path: str) -> Iterator[None]:
    """Inside, a write to ``path`` that fails (``/proc``, a full disk, no permission) is a
    ``UsageError``: one line naming the file and the system's reason, exit status 2."""
    try:
        yield
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _precision(a: argparse.Namespace) -> MixedPrecision | None:
    """``--precision bf16``/``fp16``: compute in it with fp32 master weights."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    return MixedPrecision(dtypes[a.precision]) if a.precision else None


def cmd_plan(a: argparse.Namespace) -> None:
    """Plan as ``autopar.plan`` does: a mesh, or a device count whose mesh is searched; the
    microbatches a step accumulates given (``--accumulation``) or chosen where the batch does not fit."""
    from rich.console import Console

    from autopar.planning.entry_points import plan as plan_model

    model, args, kwargs = load_model(a.model, a.options, a.batch, a.seq)
    where = (
        f"meshes of {a.devices} devices"
        if a.devices
        else "mesh " + ",".join(f"{k}={n}" for k, n in a.mesh.items())
    )
    with Console(stderr=True).status(f"planning {type(model).__name__} on {where} ..."):
        plan = plan_model(
            model,
            args,
            a.devices or a.mesh,
            example_kwargs=kwargs,
            cluster=a.cluster,
            memory_budget=a.budget,
            precision=_precision(a),
            accumulation=a.accumulation,
        )
    flags = [f"--{flag}={value}" for flag, value in (("batch", a.batch), ("seq", a.seq)) if value is not None]
    plan.source = [a.model, *a.options, *flags]  # for `show plan.json`
    print(plan.summary(width=a.width, verbose=a.verbose))
    if a.stragglers:  # sync against the update modes (docs/update_modes.md)
        print(
            update_cost.compare_updates(plan, a.stragglers, samples_per_step(a.model, a.batch, args, kwargs))
        )
    if a.output:
        with _writing(a.output):
            plan.save(a.output)
        print(f"plan written to {a.output}")


def cmd_show(a: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.compiler import lower
    from autopar.ir.mesh import MeshSpec
    from autopar.ir.plan import load_plan
    from autopar.ir.printing import format_graph
    from autopar.planning.planner import capture_for
    from autopar.tools.fake_ranks import fake_world

    if a.model.endswith(".json"):
        plan = load_plan(a.model)
        if plan.source is None:  # saved from Python: the model is not known here
            print(plan.code)
            return
        if plan.pipeline is not None:
            raise UsageError(
                f"{a.model}: show prints a pipelined plan's program from the model, not yet from the file"
            )
        spec = _parser().parse_args(["show", *plan.source])
        if not spec.model.startswith("hf:"):  # plans saved before a factory refused them record the defaults
            spec.batch = spec.seq = None
        model, args, kwargs = load_model(spec.model, spec.options, spec.batch, spec.seq)
        mesh = plan.mesh
        # captured as it was planned: in its precision, one microbatch of those it accumulates
        precision = MixedPrecision.from_dict(plan.precision) if plan.precision else None
        spec_mesh, accumulation = MeshSpec.of(mesh), plan.accumulation
        captured = capture_for(model, args, kwargs, spec_mesh, None, precision, accumulation=accumulation)
    else:
        model, args, kwargs = load_model(a.model, a.options, a.batch, a.seq)
        mesh = a.mesh
        captured, plan = _plan(a, model, args, kwargs, mesh)  # lowered as compile does: one capture
    with fake_world(math.prod(mesh.values())):
        device_mesh = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
        gm, _ = lower(captured, plan, device_mesh)
        for line in plan.named_layouts.values():  # the layouts with a name, before the program
            print(f"# layout: {line}")
        print(format_graph(gm.graph, f"per-rank program on mesh {MeshSpec.of(mesh)} (rank 0)"))


def cmd_explain(a: argparse.Namespace) -> None:
    from autopar.ir.plan import load_plan

    plan = load_plan(a.plan)
    for node in _named(plan, a.node, a.plan):
        _explain(plan, node)


def _named(plan: Any, what: str, path: str) -> list[Any]:
    """The node called ``what``, else the heavy ops of the module at path ``what`` (and inside it)."""
    by_name = [n for n in plan.nodes if n.name == what]
    inside = [
        n for n in plan.nodes if n.kind.summarised and (n.module == what or n.module.startswith(what + "."))
    ]
    if by_name or inside:
        return by_name or inside
    names = ", ".join(n.name for n in plan.nodes[:6])
    raise UsageError(
        f"{path} has no node or module {what!r} (nodes: {names}, ...; modules such as "
        f"{plan.nodes[-1].module or '<root>'}; see `autopar show`)"
    )


def _explain(plan: Any, node: Any) -> None:
    """Print why ``node`` has its strategy: the solver variable's alternatives and their costs."""
    print(f"{node.name}: {node.op} in module '{node.module or '<root>'}' ({node.kind})")
    print(f"  chosen: {_strategy(node.operands, node.outputs)}, compute {_ms(node.compute_s)}")
    if node.name in plan.named_layouts:
        print(f"  layout: {plan.named_layouts[node.name]}")
    if node.choice is None:
        print(
            "  why: it has a single strategy: an annotation or layout constraint fixes it, or no sharding "
            "rule exists for the op (replicated; listed in the plan's warnings)"
        )
        return
    shared = [n.name for n in plan.nodes if n.choice == node.choice]
    print(
        f"  its layouts follow solver variable {node.choice!r}, shared by {len(shared)} nodes "
        f"(followers of one operand and tied repeated blocks); the variable's strategies, each with "
        f"what its terms of the objective cost (compute and redistributions, neighbours as planned):"
    )
    options = sorted(plan.alternatives.get(node.choice, []), key=lambda alt: alt.seconds)
    for alt in options:
        mark = "->" if alt.chosen else "  "
        print(f"  {mark} {_strategy(alt.operands, alt.outputs)}: {_ms(alt.seconds)}")
    chosen = next((alt for alt in options if alt.chosen), None)
    if chosen is None or len(options) < 2:
        return
    best = options[0] if not options[0].chosen else options[1]
    if chosen is options[0]:
        print(
            f"  why: the cheapest of its {len(options)} strategies with every other choice as planned "
            f"({_ms(best.seconds - chosen.seconds)} below the next): its compute plus the redistributions "
            f"to and from its neighbours"
        )
    else:
        print(
            f"  why: not the cheapest alone ({_ms(chosen.seconds - options[0].seconds)} above the best); "
            f"the ILP minimises the whole step (neighbours would change with it) within the memory budget "
            f"({plan.memory.budget if plan.memory else '-'} bytes)"
        )


def _strategy(operands: Sequence[str | None], outputs: Sequence[str]) -> str:
    return f"operands {', '.join(o or '-' for o in operands) or '-'} -> outputs {', '.join(outputs)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4f} ms"


def cmd_viz(a: argparse.Namespace) -> None:
    import shutil
    import tempfile

    from autopar.tools.plan_view import plan_dot, plan_html, plan_svg

    if not a.output.endswith((".html", ".svg", ".dot")):
        raise UsageError(
            f"output {a.output!r}: viz writes a page (.html), an image (.svg) or Graphviz DOT (.dot)"
        )
    chromium = shutil.which("chromium")
    if a.output.endswith(".svg") and chromium is None:
        raise UsageError(
            "viz -o .svg draws with headless Chromium: install Debian's chromium, or write .html"
        )
    if a.model.endswith(".json"):
        from autopar.ir.plan import load_plan

        plan = load_plan(a.model)
    else:
        model, args, kwargs = load_model(a.model, a.options, a.batch, a.seq)
        _, plan = _plan(a, model, args, kwargs, a.mesh)
    title = f"autopar plan on mesh {plan.mesh_spec} ({plan.cluster['name']})"
    if a.output.endswith(".dot"):
        text = plan_dot(plan)
    elif a.output.endswith(".svg"):
        with tempfile.TemporaryDirectory() as work:
            text = plan_svg(plan_html(plan, title), chromium, Path(work), a.open)
    else:
        text = plan_html(plan, title)
    with _writing(a.output):
        Path(a.output).write_text(text)
    print(
        f"graph written to {a.output} ({len(plan.nodes)} nodes, {len(plan.redistributions)} redistributions)"
    )


def amdahl_fraction(rows: Sequence[dict[str, float]]) -> float:
    """Least-squares serial fraction ``s`` of ``T(n) = T(1) (s + (1 - s) / n)`` (strong scaling)."""
    pts = [(1 / r["devices"], 1 / r["speedup"]) for r in rows if r["devices"] > 1]
    den = sum((1 - x) ** 2 for x, _ in pts)
    return min(1.0, max(0.0, sum((y - x) * (1 - x) for x, y in pts) / den)) if den else 0.0


def gustafson_fraction(rows: Sequence[dict[str, float]]) -> float:
    """Least-squares serial fraction ``s`` of the scaled speedup ``S(n) = n - s (n - 1)``."""
    pts = [(r["devices"], r["scaled_speedup"]) for r in rows if r["devices"] > 1]
    den = sum((n - 1) ** 2 for n, _ in pts)
    return min(1.0, max(0.0, sum((n - s) * (n - 1) for n, s in pts) / den)) if den else 0.0


def cmd_scaling(a: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    devices = sorted({1, *a.devices})  # one device is the reference
    model, args, kwargs = load_model(a.model, a.options, a.batch, a.seq)
    with Console(stderr=True).status(f"planning for {len(devices)} device counts ..."):
        rows = scaling_table(model, args, kwargs, devices, a.axis, get_cluster(a.cluster), _precision(a))
    s, g = amdahl_fraction(rows), gustafson_fraction(rows)
    table = Table(title=f"predicted scaling over {a.axis} ({a.cluster})")
    for col in ("devices", "step", "speedup", "efficiency", "grown-batch step", "scaled speedup"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            str(r["devices"]),
            f"{r['step_s'] * 1e3:.3f} ms",
            f"{r['speedup']:.2f}x",
            f"{r['efficiency']:.0%}",
            f"{r['grown_step_s'] * 1e3:.3f} ms",
            f"{r['scaled_speedup']:.2f}x",
        )
    console = Console(width=a.width)
    console.print(table)
    amdahl = [1 / (s + (1 - s) / r["devices"]) for r in rows]
    gustafson = [r["devices"] - g * (r["devices"] - 1) for r in rows]
    off_a, off_g = _misfit(rows, "speedup", amdahl), _misfit(rows, "scaled_speedup", gustafson)
    bound = f", speedup bound {1 / s if s else math.inf:.1f}x" if off_a <= FAIR_FIT else ""
    console.print(
        f"Amdahl (fixed batch): serial fraction {s:.3f}{bound} ({_fit_words(off_a)}); "
        f"Gustafson (batch grown with devices): serial fraction {g:.3f} ({_fit_words(off_g)})"
    )
    if a.plot:
        title = f"{a.model} over {a.axis} ({a.cluster})"
        with _writing(a.plot):
            plot_scaling(rows, (s, amdahl, off_a), (g, gustafson, off_g), title, a.plot)
        console.print(f"plot written to {a.plot}")


def cmd_calibrate(a: argparse.Namespace) -> None:
    from autopar.tools.calibrate import run_calibrate

    report = run_calibrate(a.output, a.ranks, a.device, a.links)
    if report:  # under torchrun only rank 0 reports
        print(report)


#: A fit off by at most this (relative) at every point is quoted; a worse one is called poor.
FAIR_FIT = 0.1


def _misfit(rows: Sequence[dict[str, float]], key: str, fit: Sequence[float]) -> float:
    """The largest relative distance between the predicted points and a fit."""
    return max((abs(f - r[key]) / r[key] for r, f in zip(rows, fit)), default=0.0)


def _fit_words(off: float) -> str:
    if off <= FAIR_FIT:
        return f"fits every point within {off:.0%}"
    return f"a poor fit, off by up to {off:.0%}: the plan's steps do not follow this law"


# --- entry ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, its errors on one line (the usage is ``autopar COMMAND --help``)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def model_command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("model", help="path/to/file.py:factory or hf:ARCH")
        p.add_argument("options", nargs="*", help="key=value for the factory or the transformers config")
        p.add_argument(
            "--cluster",
            type=cluster_name,
            default="cpu-gloo",
            help="cluster preset (cpu-gloo, h100, fast-links)",
        )
        p.add_argument(
            "--batch", type=positive_int, help="hf: models: sequences in the example batch (default 8)"
        )
        p.add_argument("--seq", type=positive_int, help="hf: models: tokens per sequence (default 128)")
        p.add_argument("--width", type=width, default=140, help="table width in characters (>= 40)")
        p.add_argument("--precision", choices=("bf16", "fp16"), help="compute in it, fp32 master weights")
        return p

    plan = model_command("plan", "plan a model and print the plan")
    where = plan.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", type=parse_mesh, help="e.g. dp=8,tp=8")
    where.add_argument("--devices", type=positive_int, help="a device count: the mesh is searched too")
    plan.add_argument(
        "--budget", type=parse_bytes, help="memory per device, e.g. 80GB (default: the cluster's)"
    )
    plan.add_argument(
        "--accumulation",
        type=positive_int,
        help="microbatches each step accumulates, with --mesh (default: 1, more where the batch won't fit)",
    )
    plan.add_argument("-o", "--output", type=writable, help="save the plan as JSON here")
    plan.add_argument("--verbose", action="store_true", help="every op and redistribution in the tables")
    plan.add_argument("--stragglers", type=parse_slowdowns, help="e.g. 1,1,1,3: dp replicas' slowdowns")
    plan.set_defaults(run=cmd_plan)
    show = model_command("show", "print the per-rank program (or a saved plan's graph)")
    show.add_argument("--mesh", type=parse_mesh, default="dp=1", help="e.g. dp=2,tp=2")
    show.add_argument("--budget", type=parse_bytes, help="memory per device, e.g. 80GB")
    show.set_defaults(run=cmd_show)
    viz = model_command("viz", "the planned graph as a page or for Graphviz (collectives in red)")
    viz.add_argument("--mesh", type=parse_mesh, default="dp=1", help="e.g. dp=2,tp=2 (with a model)")
    viz.add_argument("--budget", type=parse_bytes, help="memory per device, e.g. 80GB")
    viz.add_argument(
        "-o", "--output", type=writable, required=True, help="graph.html, graph.svg or graph.dot"
    )
    viz.add_argument("--open", default="", help=".svg: modules to draw opened, e.g. blocks,blocks.0")
    viz.set_defaults(run=cmd_viz)
    explain = sub.add_parser(
        "explain", help="why a node of a saved plan has its layouts, and the alternatives"
    )
    explain.add_argument("plan", help="a plan saved by autopar plan -o")
    explain.add_argument("node", help="a node name (as `autopar show` prints them) or a module path")
    explain.set_defaults(run=cmd_explain)
    scaling = model_command("scaling", "predicted speedup and efficiency over device counts")
    scaling.add_argument(
        "--devices", type=parse_counts, default="1,2,4,8", help="device counts, e.g. 1,2,4,8,16"
    )
    scaling.add_argument("--axis", default="dp", help="the mesh axis the devices form")
    scaling.add_argument("--plot", type=plot_file, help="write a speedup plot here (.png or .svg)")
    scaling.set_defaults(run=cmd_scaling)
    calibrate = sub.add_parser(
        "calibrate",
        help="measure compute, memory and each collective per node level into a cluster file for "
        "--cluster: on --ranks local ranks, or under torchrun on its world (rank 0 writes)",
    )
    calibrate.add_argument(
        "--ranks", type=positive_int, help="local gloo ranks measured at once (default 2; not under torchrun)"
    )
    calibrate.add_argument("--device", help="time this one device instead (cuda, cuda:1)")
    calibrate.add_argument("--links", help="with --device: the preset its links come from (default h100)")
    calibrate.add_argument("-o", "--output", type=writable, required=True, help="cluster.json")
    calibrate.set_defaults(run=cmd_calibrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (2 for bad input, with one line on stderr)."""
    from autopar.ir.errors import AutoparError

    parser = _parser()
    a, extra = parser.parse_known_args(argv)
    # key=value model options may also follow the flags
    unknown = [w for w in extra if w.startswith("-") or "=" not in w]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(a, "options"):
        a.options = [*a.options, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        a.run(a)
    except (UsageError, AutoparError) as exc:
        print(f"autopar {a.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        # the reader stopped (`| head`): nothing more to print; stdout goes nowhere so that
        # flushing it at exit raises nothing either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
