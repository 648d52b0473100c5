"""Outline each recompute region into one activation-checkpointed submodule.

A region is the set of ``call_function`` nodes whose ``node.meta["autopar.recompute"]``
is ``(region, policy)`` with the same ``region`` string and the same ``autopar.stage``
(a region spanning stages becomes one region per stage). Each region is replaced by a
``call_module`` node calling a :class:`Recomputed` submodule registered on the graph
module as ``recompute_<i>`` (in graph order), which runs a copy of the region's nodes
under ``torch.utils.checkpoint`` with selective checkpointing:

- ``"full"`` (:data:`FULL`): the outputs of autopar ops (collectives and their local
  counterparts) are kept, so backward does not communicate again; everything else is
  recomputed in backward.
- ``"selective"`` (:data:`SELECTIVE`): also keeps the outputs of matrix products and
  attention; only the cheap ops between them are recomputed.
- ``"full-comm"`` (:data:`FULL_COMM`): keeps nothing but the region's inputs; every op runs
  again in backward, its collectives included (MindSpore's ``mp_comm_recompute``, Megatron-LM's
  full recompute). Every rank runs the same region graph, so the repeated collectives are issued
  in the same order on every rank; torch stops the recomputation at the region's last op saving
  a tensor, so collectives after it (a block's closing all-reduce) do not run again.

Under the first two, an autopar op marked ``node.meta["autopar.regather"]`` (a ZeRO-3
parameter gather) is recomputed, i.e. gathered again in backward and never kept. A ``"full"``
region without autopar ops has nothing to keep, and a ``"full-comm"`` region keeps nothing: they
run under plain checkpointing, which recomputes every op just the same without the selective
policy's dispatch of each op (Python, twice: on a CPU half of what a recomputed op costs besides
its compute, :func:`~autopar.ir.options.uses_policy`).

The call returns a tuple with one entry per region value used outside the region; each
such value's node stays in the graph, under its name, as an ``operator.getitem`` of the
call, so the nodes reading it and everything keyed by node names are unaffected. Nodes of
a region may be interleaved with other nodes: nodes between them that depend on the region
move after the call. A region that reads a value depending on the region itself through
an outside node cannot be outlined and raises :class:`~autopar.ir.errors.CompileError`.

Reads: ``autopar.recompute``, ``autopar.regather``, ``autopar.stage``, ``autopar.layouts``,
``val``, ``nn_module_stack``. Writes: on the ``call_module`` node ``val`` (the tuple of
the outputs' values), ``autopar.stage`` and ``nn_module_stack`` (of the region's first
node); on each output (now a ``getitem``) ``autopar.layouts`` becomes ``(outputs,
outputs)`` of the value's output layouts, as for any ``getitem``, and ``autopar.recompute``,
``autopar.regather`` and ``autopar.grads`` are dropped. A graph without regions is returned
unchanged.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.ir.errors import CompileError
from autopar.ir.meta import GRADS, LAYOUTS, RECOMPUTE, REGATHER, STAGE, NodeLayouts, write_layouts
from autopar.ir.ops import is_autopar_op, is_selective_save
from autopar.ir.options import FULL_COMM, POLICIES, SELECTIVE, uses_policy


def policy_fn(policy: str, regathers: tuple[bool, ...]) -> Callable[..., CheckpointPolicy]:
    """A selective-checkpoint policy function for one run of a region.

    ``regathers[k]`` says whether the ``k``-th autopar op the region runs is a regather; under
    :data:`FULL_COMM` every op, autopar ops included, is recomputed (what plain checkpointing
    does: the policy is there for ``autopar calibrate`` to time a region both ways).
    The policy sees ops, not graph nodes, so it counts autopar calls: a region graph runs
    its nodes in graph order and each autopar node dispatches exactly one autopar op.
    Make a new function for every run (``context_fn`` is called once per checkpoint call),
    so the count starts at zero. Raises ``RuntimeError`` if the region runs more autopar
    ops than ``regathers`` lists.
    """
    if policy not in POLICIES:
        raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
    # torch < 2.13 also consulted the policy while recomputing (is_recompute=True): counting
    # each phase apart keeps the indexes right either way.
    calls: Counter[bool] = Counter()

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if is_autopar_op(op):
            k = calls[ctx.is_recompute]
            calls[ctx.is_recompute] += 1
            if k >= len(regathers):
                raise RuntimeError(
                    f"a recompute region ran autopar op #{k} ({op}) but its graph has {len(regathers)}; "
                    "autopar ops must be plain nodes of the region graph"
                )
            again = regathers[k] or policy == FULL_COMM
            return CheckpointPolicy.PREFER_RECOMPUTE if again else CheckpointPolicy.MUST_SAVE
        if policy == SELECTIVE and is_selective_save(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


class Recomputed(torch.nn.Module):
    """Runs ``region`` (a graph module returning a tuple) under activation checkpointing.

    ``forward(*inputs)`` returns what ``region(*inputs)`` returns; in backward the ops the
    policy does not keep run again (see the module docstring and :func:`policy_fn`), under the
    selective checkpoint's policy where ``selective`` (:func:`uses_policy`), else under plain
    checkpointing.
    """

    def __init__(self, region: torch.fx.GraphModule, policy: str) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
        self.region = region
        self.policy = policy
        # Fixed now, from the region graph's node meta, in the order the autopar ops run.
        self.regathers = tuple(
            bool(n.meta.get(REGATHER))
            for n in region.graph.nodes
            if n.op == "call_function" and is_autopar_op(n.target)
        )
        # under the selective checkpoint's policy (uses_policy); calibrate sets it to time both ways
        self.selective = uses_policy(policy, bool(self.regathers))

    def forward(self, *inputs: Any) -> Any:
        if not self.selective:
            return checkpoint(self.region, *inputs, use_reentrant=False)
        return checkpoint(self.region, *inputs, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self) -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(policy_fn(self.policy, self.regathers))

    def extra_repr(self) -> str:
        return f"policy={self.policy!r}"


def region_nodes(graph: torch.fx.Graph) -> dict[tuple[str, int | None], list[torch.fx.Node]]:
    """The ``call_function`` nodes of each region, keyed by ``(region, stage)``, in graph order.

    Keys come in the order of their first node; ``stage`` is ``None`` without
    ``autopar.stage``. Raises :class:`CompileError` for an unknown policy or a region whose
    nodes disagree on it.
    """
    regions: dict[tuple[str, int | None], list[torch.fx.Node]] = {}
    policies: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_function" or RECOMPUTE not in node.meta:
            continue
        region, policy = node.meta[RECOMPUTE]
        if policy not in POLICIES:
            raise CompileError(f"{node.name}: recompute policy must be one of {POLICIES}, got {policy!r}")
        if policies.setdefault(region, policy) != policy:
            raise CompileError(
                f"{node.name}: recompute region {region!r} is {policy!r} here but {policies[region]!r} before"
            )
        regions.setdefault((region, node.meta.get(STAGE)), []).append(node)
    return regions


def run(gm: torch.fx.GraphModule, ctx: object) -> torch.fx.GraphModule:
    """Outline every recompute region of ``gm`` in place (see the module docstring); ``ctx`` is unused."""
    graph = gm.graph
    for node in graph.nodes:
        if node.meta.get(REGATHER) and RECOMPUTE not in node.meta:
            raise CompileError(
                f"{node.name} is a regather but in no recompute region: nothing would gather it again "
                "in backward"
            )
        if node.meta.get(REGATHER) and not (node.op == "call_function" and is_autopar_op(node.target)):
            raise CompileError(f"{node.name} is marked a regather but is no autopar collective")
    regions = region_nodes(graph)
    if not regions:
        return gm
    index = 0
    while regions:
        (_, stage), nodes = next(iter(regions.items()))
        while hasattr(gm, f"recompute_{index}"):
            index += 1
        _outline(gm, f"recompute_{index}", nodes, stage)
        index += 1
        # Outlining moves nodes (a later region's among them): take the regions afresh.
        regions = region_nodes(graph)
    graph.lint()
    gm.recompile()
    return gm


def _outline(gm: torch.fx.GraphModule, name: str, nodes: list[torch.fx.Node], stage: int | None) -> None:
    """Replace ``nodes`` (one region, in graph order) by a call of a new submodule ``name``."""
    graph = gm.graph
    members = set(nodes)
    policy = nodes[0].meta[RECOMPUTE][1]
    # Nodes between the region's first and last node that depend on the region must follow
    # the call, which goes where the last node is; a region node depending on one of them
    # would need the call both before and after it.
    moved: list[torch.fx.Node] = []
    after_region: set[torch.fx.Node] = set()
    node = nodes[0]
    while node is not nodes[-1]:
        node = node.next
        if node in members:
            late = [a for a in node.all_input_nodes if a in after_region]
            if late:
                raise CompileError(
                    f"recompute region {nodes[0].meta[RECOMPUTE][0]!r}: {node.name} reads {late[0].name}, "
                    "which is computed outside the region from the region's values; outlining it would "
                    "form a cycle"
                )
        elif any(a in members or a in after_region for a in node.all_input_nodes):
            after_region.add(node)
            moved.append(node)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    outputs = [n for n in nodes if any(u not in members for u in n.users)]

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        # An input may come from another region not outlined yet: its marks stay on its node.
        env[a].meta = {k: v for k, v in a.meta.items() if k not in (RECOMPUTE, REGATHER)}
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    sub.lint()
    gm.add_submodule(
        name, Recomputed(torch.fx.GraphModule(torch.nn.Module(), sub, class_name="Region"), policy)
    )

    with graph.inserting_after(nodes[-1]):
        call = graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    if stage is not None:
        call.meta[STAGE] = stage
    if "nn_module_stack" in nodes[0].meta:
        call.meta["nn_module_stack"] = nodes[0].meta["nn_module_stack"]
    # Each output becomes a getitem of the call in place: its name, users and meta stay.
    last = call
    for k, out in enumerate(outputs):
        out.target, out.args, out.kwargs = operator.getitem, (call, k), {}
        for key in (RECOMPUTE, REGATHER, GRADS):
            out.meta.pop(key, None)
        if LAYOUTS in out.meta:
            laid_out = out.meta[LAYOUTS][1]
            write_layouts(out, NodeLayouts(operands=laid_out, outputs=laid_out))
        last.append(out)
        last = out
    for n in moved:
        last.append(n)
        last = n
    for n in reversed(nodes):
        if n not in outputs:
            graph.erase_node(n)
