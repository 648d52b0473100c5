"""Which node runs in which pipeline stage: annotated stages, the units of the automatic split,
and the placement of every other node (the rules are in :mod:`autopar.planning.pipeline.stage_plan`'s
docstring); :func:`check_stage_memory` asks whether any split of the units fits at all.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from autopar.capture.export import BLOCK_PATH, Captured, block_of
from autopar.ir.errors import AnnotationError, PlanError
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import module_stack, storage_ref, written_storages
from autopar.ir.options import Pipeline
from autopar.planning.pipeline.stage_split import UnitCosts, partition


def annotated_anchors(captured: Captured) -> dict[torch.fx.Node, int]:
    """The stage of every op inside an annotated module (its innermost annotated ancestor's).

    Also checks that every parameter's module (or a module around it) has a stage.
    """
    stages = captured.annotations.stages
    for fqn in captured.params.values():
        owner = fqn.rpartition(".")[0]
        path = owner
        while path not in stages and path:
            path = path.rpartition(".")[0]
        if path not in stages:
            raise AnnotationError(
                f"pipeline_stage: parameter {fqn!r} belongs to module {owner or '<root>'!r}, which has no "
                f"stage, nor has any module around it; give every module with parameters a stage"
            )
    anchors = {}
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        for path in reversed(module_stack(node)):
            if path in stages:
                anchors[node] = stages[path]
                break
    return anchors


def place(captured: Captured, anchors: Mapping[torch.fx.Node, int]) -> dict[torch.fx.Node, int]:
    """Positions of every placeholder and op from the ``anchors`` (module docstring's rules)."""
    stage: dict[torch.fx.Node, int] = dict(anchors)
    anchored = set(anchors)
    for node in captured.graph.nodes:
        if node.op == "placeholder" and node.name in captured.inputs:
            stage[node] = 0
            anchored.add(node)
        elif node.op == "call_function" and node not in anchored:
            homes = [stage[a] for a in node.all_input_nodes if a in anchored]
            if homes:
                stage[node] = max(homes)
                anchored.add(node)
    for node in reversed(captured.graph.nodes):
        if node.op in ("placeholder", "call_function") and node not in anchored:
            users = [stage[u] for u in node.users if u in stage]
            stage[node] = min(users) if users else 0
    return stage


def complete_stages(
    captured: Captured, anchors: Mapping[torch.fx.Node, int], n_stages: int
) -> dict[torch.fx.Node, int]:
    """Every placeholder's and op's stage, from the ``anchors`` (see the module docstring).

    Raises ``AnnotationError`` where a stage reads a value of a later stage or a
    parameter (or a buffer some op writes) is used in two stages, and ``PlanError`` where a
    stage is empty. A constant buffer read by several stages is not refused: each holds a copy
    (:func:`shared_constants`); its position here is the first of them.
    """
    stage = place(captured, anchors)
    state = {**captured.params, **captured.buffers}
    shared = shared_constants(captured, stage)
    for node, home in stage.items():
        used_in = sorted({stage[u] for u in node.users if u in stage})
        if node.name in state and len(used_in) > 1 and node not in shared:
            users = ", ".join(sorted({_where(u) for u in node.users}))
            names = " = ".join(repr(a) for a in captured.aliases.get(state[node.name], [state[node.name]]))
            raise AnnotationError(
                f"parameter {names} is used in pipeline stages {used_in} (by {users}); "
                f"a parameter can live in one stage only: untie shared weights (e.g. tied embeddings) "
                f"or put their users in one stage"
            )
        for user in node.users:
            if user in stage and stage[user] < home:
                raise AnnotationError(
                    f"pipeline stages must follow the order of the forward: {_where(user)} in stage "
                    f"{stage[user]} uses {node.name} computed in {_where(node)} in stage {home}"
                )
    used = {s for n, s in stage.items() if n.op == "call_function"}
    empty = sorted(set(range(n_stages)) - used)
    if empty:
        raise PlanError(
            f"pipeline stage(s) {empty} of {n_stages} run no operation; annotate modules that run "
            f"in every stage, or use fewer stages"
        )
    return stage


def constant_buffers(captured: Captured) -> set[str]:
    """The placeholders of the buffers no op writes in place: not directly, not through a view, not
    inside a region export keeps as a submodule (a ``torch.no_grad`` block). A write is told by the
    storage it lands in, which a view shares with its base and a region's inputs with the values
    passed in. Only parameters get gradients, so such a buffer (a rotary table) is a constant,
    which any number of pipeline stages may read; batch norm's running statistics are not."""
    written = written_storages(captured.program.graph_module)
    return {
        node.name
        for node in captured.graph.nodes
        if node.op == "placeholder"
        and node.name in captured.buffers
        and storage_ref(node.meta["val"]) not in written
    }


def shared_constants(
    captured: Captured, stage: Mapping[torch.fx.Node, int]
) -> dict[torch.fx.Node, tuple[int, ...]]:
    """Each constant buffer (:func:`constant_buffers`) that ops of more than one stage (or unit) of
    ``stage`` read, with those stages in order: every one of them holds a copy of it."""
    constants = constant_buffers(captured)
    shared = {}
    for node in captured.graph.nodes:
        if node.name in constants:
            readers = tuple(sorted({stage[u] for u in node.users if u in stage}))
            if len(readers) > 1:
                shared[node] = readers
    return shared


def _where(node: torch.fx.Node) -> str:
    path = module_stack(node)[-1] if module_stack(node) else ""
    return f"module {path!r}" if path else "the root module"


def unit_name(node: torch.fx.Node) -> str:
    """The outermost repeated block (``blocks.3``) a node runs in, else its top-level module."""
    paths = [p for p in module_stack(node) if p]
    return block_of(node) or (paths[0] if paths else "<root>")


def units(captured: Captured) -> list[list[torch.fx.Node]]:
    """The ops cut into the units of the automatic split, in execution order.

    A model with repeated blocks (``blocks.3``) has one unit per block; the ops before the
    first block (embeddings) join it, the ops between two blocks join the next, and the
    ops after the last (final norm, head, loss) join that one, as hand-written splits do,
    so that every stage runs whole blocks. A model without repeated blocks has one unit
    per maximal run of ops in one top-level module (:func:`unit_name`).
    """
    runs: list[list[torch.fx.Node]] = []
    names: list[str] = []
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        name = unit_name(node)
        if not runs or name != names[-1]:
            runs.append([])
            names.append(name)
        runs[-1].append(node)
    if not any(BLOCK_PATH.match(name) for name in names):
        return runs
    out: list[list[torch.fx.Node]] = []
    pending: list[torch.fx.Node] = []
    for run, name in zip(runs, names):
        pending += run
        if BLOCK_PATH.match(name):
            out.append(pending)
            pending = []
    out[-1] += pending
    return out


def check_stage_memory(
    captured: Captured,
    pipeline: Pipeline,
    mesh: MeshSpec,
    memory_bytes: float,
    state_bytes: Mapping[str, tuple[float, ...]],
    activation_bytes: Mapping[str, float],
) -> None:
    """Raise :class:`~autopar.planning.pipeline.stage_split.PipelineFitError` when no split of the units
    into stages fits ``memory_bytes``, judged by memory alone: the split :func:`partition` makes
    from the whole plan exists exactly when one does here, so a plan that cannot fit is refused
    before its costs, redistributions and printed program are assembled. Annotated stages are
    not split, and are not checked here."""
    if captured.annotations.stages or memory_bytes == float("inf"):
        return
    n, _, placed = placed_units(captured)
    # with no seconds every split is as fast: only whether one fits is asked
    costs = unit_memory(captured, placed, n, state_bytes, activation_bytes)
    partition(costs, pipeline, pipeline.size(mesh), memory_bytes)


def placed_units(
    captured: Captured,
) -> tuple[int, dict[torch.fx.Node, int], dict[torch.fx.Node, int]]:
    """How many units there are (see :func:`units`), the unit of each of their nodes, and the
    unit every placeholder and op is placed in."""
    cut_units = units(captured)
    unit_of = {node: i for i, u in enumerate(cut_units) for node in u}
    return len(cut_units), unit_of, place(captured, unit_of)


def unit_memory(
    captured: Captured,
    placed: Mapping[torch.fx.Node, int],
    n: int,
    state_bytes: Mapping[str, tuple[float, ...]],
    activation_bytes: Mapping[str, float],
) -> UnitCosts:
    """The bytes of the ``n`` units (every node ``placed`` in one), and no seconds: per unit, the
    bytes held whatever is in flight (parameters, gradients, optimizer state) and the activation
    bytes of one microbatch; a constant buffer several units read, once per stage holding any
    of them (:func:`shared_constants`)."""
    shared = shared_constants(captured, placed)
    fixed, act = [0.0] * n, [0.0] * n
    copied: dict[tuple[int, ...], float] = {}
    for node, i in placed.items():
        held = sum(node_held_bytes(state_bytes, node))
        if node in shared:
            copied[shared[node]] = copied.get(shared[node], 0.0) + held
        else:
            fixed[i] += held
        act[i] += activation_bytes.get(node.name, 0.0)
    zeros = [0.0] * n
    return UnitCosts(zeros, fixed, act, zeros, copied_bytes=copied)


def node_held_bytes(
    state_bytes: Mapping[str, tuple[float, ...]], node: torch.fx.Node
) -> tuple[float, float, float]:
    """The device bytes ``node`` holds on one rank whatever is in flight: a parameter's or
    buffer's own, its gradient's and its optimizer state's (zeros for any other node)."""
    return tuple(state_bytes[node.name][:3]) if node.name in state_bytes else (0.0, 0.0, 0.0)
