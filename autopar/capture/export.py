"""Capture: an ``nn.Module`` and example inputs become an ATen graph.

``torch.export.export(..., strict=False)`` runs the model's Python as usual and
records ATen ops, which works on transformers' GPT-2, Llama and BERT where
``torch.fx.symbolic_trace`` fails. Parameters may live on the ``meta`` device and
inputs may be meta tensors, so planning a 7B model allocates nothing.

The annotation hooks are active during export, so every ``shard`` in/out strategy
and every ``constrain`` call appears in the graph as an
``autopar::layout_constraint`` node.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from autopar.capture.annotations import (
    ModelAnnotations,
    describe_module,
    unclaimed_annotations,
    under_every_name,
)
from autopar.capture.constraint_op import constraint_spec, layout_constraint
from autopar.capture.exact_means import ExactMeans
from autopar.capture.example_inputs import check_shapes, check_values, input_labels, non_tensor_hint
from autopar.capture.functionalize import functionalize
from autopar.capture.fused_parts import split_fused_projections
from autopar.capture.hooks import annotation_hooks, check_strategies_ran
from autopar.capture.precision import cast_parameters, traced_in
from autopar.ir.errors import AnnotationError, CaptureError
from autopar.ir.mesh import MeshSpec
from autopar.ir.meta import module_path, module_stack, output_values
from autopar.ir.options import MixedPrecision


@dataclass
class Captured:
    """An exported model and the names planning needs.

    ``params`` and ``buffers`` map placeholder names to fully-qualified names in
    the user's module; ``aliases`` maps each of those names to every name the same
    tensor has in the module (tied weights have several); ``inputs`` lists the
    user-input placeholders in order.
    """

    program: torch.export.ExportedProgram
    params: dict[str, str]
    buffers: dict[str, str]
    inputs: list[str]
    annotations: ModelAnnotations
    aliases: dict[str, list[str]] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    dropped_outputs: list[str] = field(default_factory=list)  # outputs the program returns as None
    # annotations made on modules outside the model (autopar.capture.annotations.unclaimed_annotations)
    unapplied: list[str] = field(default_factory=list)
    number_outputs: tuple[int, ...] = ()  # output leaves the model returns as Python numbers (.item())
    precision: MixedPrecision | None = None  # the compute dtype it was traced in (capture/precision.py)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph_module.graph


# A numbered child is one of a list's repeated blocks: ``blocks.3`` of a ModuleList, or ``3`` of a
# root Sequential. The one definition of a block: free layout points at capture, tied strategies,
# pipeline units and memory-search candidates all use it.
BLOCK_PATH = re.compile(r"^(.*\.)?\d+$")


def block_of(node: torch.fx.Node) -> str | None:
    """The outermost repeated block (``blocks.3``, see :data:`BLOCK_PATH`) a node runs in, if any."""
    return next((p for p in module_stack(node) if p and BLOCK_PATH.match(p)), None)


def repeated_blocks(graph: torch.fx.Graph) -> list[str]:
    """The outermost repeated blocks the ops of ``graph`` run in, in execution order."""
    return list(dict.fromkeys(b for n in graph.nodes if n.op == "call_function" and (b := block_of(n))))


_HINTS = (
    (
        "data-dependent",
        "the model branches on tensor values; use torch.where or torch.cond, "
        "or make the branch depend on shapes only",
    ),
    ("GuardOnDataDependent", "the model branches on tensor values; use torch.where or torch.cond"),
    ("not implemented for 'Meta'", "an op has no meta kernel: plan with real (small) example tensors"),
    ("unexpected keyword argument", "example_kwargs do not match the model's forward() signature"),
    ("positional argument", "example_args do not match the model's forward() signature"),
)


@contextmanager
def _block_inputs(model: torch.nn.Module) -> Iterator[None]:
    """Mark the tensor inputs and outputs of every repeated block (``layers.3``) as free layout choice points.

    Cheap ops follow their operand's layout, so without such points the residual stream
    would carry one layout from the embedding to the loss; at a block boundary the
    solver may change it (the mark is an identity that the compiler removes).
    """

    def mark(values: Any, where: str) -> Any:
        def free(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return layout_constraint(t, constraint_spec(None, where))
            return t

        return torch.utils._pytree.tree_map(free, values)

    handles = []
    for path, mod in model.named_modules():
        if BLOCK_PATH.match(path):
            handles.append(
                mod.register_forward_pre_hook(
                    lambda m, a, k, path=path: mark((a, k), f"input of block '{path}'"), with_kwargs=True
                )
            )
            handles.append(
                mod.register_forward_hook(lambda m, a, o, path=path: mark(o, f"output of block '{path}'"))
            )
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _track_modules(model: torch.nn.Module) -> Iterator[tuple[list[tuple[str, str]], set[str]]]:
    """Keep a stack of the modules running, to say where a capture failed, and the paths of
    those whose forward ran."""
    running: list[tuple[str, str]] = []
    ran: set[str] = set()
    handles = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__

        def pre(_m, _a, name=name, cls=cls):
            running.append((name, cls))
            ran.add(name)

        def post(_m, _a, _o):
            if running:
                running.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield running, ran
    finally:
        for h in handles:
            h.remove()


# what a captured program can return; any other output value (a key/value cache object) is dropped
_RETURNABLE = (torch.Tensor, int, float, bool, str, type(None))


class _NumbersAsTensors(TorchFunctionMode):
    """While capturing, ``t.item()`` gives ``t`` detached (0-d) instead of a Python number.

    A number computed from a split value must come from the whole value (a Partial sum
    reduced first); as a tensor it stays in the graph, where the plan reduces it like any
    output. ``numbers`` keeps each such tensor, so outputs that are numbers can be told
    apart and turned back into numbers after the program runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.numbers: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is not torch.Tensor.item:
            return func(*args, **(kwargs or {}))
        number = args[0].detach()
        self.numbers[id(number)] = number
        return number


@contextmanager
def _returnable_outputs(model: torch.nn.Module) -> Iterator[tuple[list[str], list[int]]]:
    """While active, ``model``'s outputs that export cannot return become ``None``, and
    numbers taken with ``.item()`` are returned as tensors.

    A training step needs no key/value cache, yet transformers' models return one (a
    ``DynamicCache``) unless called with ``use_cache=False``, and export refuses it. Each
    dropped output is listed (its path and type), for the plan to say so; each output
    that is a number is listed by its position among the output's leaves.
    """
    dropped: list[str] = []
    numbers: list[int] = []
    mode = _NumbersAsTensors()

    def keep_returnable(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        leaves, spec = torch.utils._pytree.tree_flatten_with_path(output)
        numbers.extend(i for i, (_, v) in enumerate(leaves) if id(v) in mode.numbers)
        if all(isinstance(v, _RETURNABLE) for _, v in leaves):
            return None
        kept = []
        for path, value in leaves:
            if not isinstance(value, _RETURNABLE):
                dropped.append(f"output{torch.utils._pytree.keystr(path)} ({type(value).__name__})")
                value = None
            kept.append(value)
        return torch.utils._pytree.tree_unflatten(kept, spec)

    handle = model.register_forward_hook(keep_returnable)
    try:
        with mode:
            yield dropped, numbers
    finally:
        handle.remove()


def _distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of repeated input tensors: export would give one tensor passed twice (say
    ``input_ids`` as ``labels`` too) a single placeholder, and the program would then
    read one input where the model reads two."""
    seen: set[int] = set()

    def distinct(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            if id(t) in seen:
                return t.clone()
            seen.add(id(t))
        return t

    return torch.utils._pytree.tree_map(distinct, (args, kwargs))


@contextmanager
def _stack_traces(kept: bool) -> Iterator[None]:
    """Export with a Python stack trace on every node only where ``kept``: taking and symbolizing
    one per op is a large share of a large model's capture; planning reads none of them
    (it names modules, from ``nn_module_stack``), while a compiled program's errors name the line
    of the user's code that recorded the failing op from them.
    ``tests/test_planner.py`` fails if torch drops the switch."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = not kept
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def capture(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None,
    mesh: MeshSpec,
    precision: MixedPrecision | None = None,
    stack_traces: bool = False,
) -> Captured:
    """Export ``model(*args, **kwargs)`` with annotations recorded; see module docstring. Under
    ``precision`` the model is traced in its compute dtype (:mod:`autopar.capture.precision`);
    with ``stack_traces`` each node keeps the user's stack where it was recorded (a compiled
    program's errors name the line; planning needs none). The example inputs are checked
    (:mod:`autopar.capture.example_inputs`): no empty dim, ids inside the tables they look up,
    one dtype per matrix product."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"autopar plans an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    args, kwargs = _distinct_inputs(args, dict(kwargs or {}))
    check_shapes(input_labels(model, args, kwargs))
    unapplied = unclaimed_annotations(model)  # an annotation lost with a replaced module raises here
    with (
        annotation_hooks(model, mesh) as annotations,
        _block_inputs(model),
        _track_modules(model) as (running, ran),
        _returnable_outputs(model) as (dropped, numbers),
        ExactMeans(),
        traced_in(model, precision) as dtypes,
        _stack_traces(stack_traces),
    ):
        program = _export(model, args, kwargs, running)
        check_strategies_ran(model)
    _refuse_recompute_not_run(model, annotations, ran)
    check_values(program, model, args, kwargs)
    if precision is not None:
        cast_parameters(program, model, dtypes, precision)
    _refuse_data_dependent_shapes(program.graph, type(model).__name__)
    functionalize(program.graph_module)  # in-place ops on temporaries, as out-of-place ones where exact
    sig = program.graph_signature
    params, buffers = dict(sig.inputs_to_parameters), dict(sig.inputs_to_buffers)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    names_of: dict[int, list[str]] = {}
    for fqn, tensor in named.items():
        names_of.setdefault(id(tensor), []).append(fqn)
    aliases = {fqn: names_of.get(id(named.get(fqn)), [fqn]) for fqn in (*params.values(), *buffers.values())}
    annotations = under_every_name(annotations, aliases)
    read = {n.name for n in program.graph.nodes if n.op == "placeholder" and n.users}
    annotated = {  # a tied weight's twin placeholder that nothing reads has no projection to split
        name: (fqn, *annotations.parameter_parts[fqn])
        for name, fqn in params.items()
        if fqn in annotations.parameter_parts and name in read
    }
    split_fused_projections(program.graph_module, mesh, annotated)  # unequal parts: one projection each
    inputs = [n.name for n in program.graph.nodes if n.op == "placeholder" and n.name in set(sig.user_inputs)]
    requires_grad = {name: bool(named[fqn].requires_grad) for name, fqn in params.items()}
    for node in program.graph.nodes:
        if node.name in inputs and isinstance(node.meta.get("val"), torch.Tensor):
            requires_grad[node.name] = bool(node.meta["val"].requires_grad)
    return Captured(
        program=program,
        params=params,
        buffers=buffers,
        inputs=inputs,
        annotations=annotations,
        aliases=aliases,
        requires_grad=requires_grad,
        dropped_outputs=dropped,
        unapplied=unapplied,
        number_outputs=tuple(numbers),
        precision=precision,
    )


def _export(
    model: torch.nn.Module, args: tuple, kwargs: dict, running: list[tuple[str, str]]
) -> torch.export.ExportedProgram:
    """``torch.export.export`` (non-strict); a failure is a ``CaptureError`` naming the module that was
    ``running`` and a hint (an ``AnnotationError`` raised inside stays one)."""
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except AnnotationError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with context below
        cause = exc
        while cause.__cause__ is not None and not isinstance(cause, AnnotationError):
            cause = cause.__cause__
        if isinstance(cause, AnnotationError):
            raise cause from None
        where = f" while running module '{running[-1][0] or '<root>'}' ({running[-1][1]})" if running else ""
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = (
            non_tensor_hint(input_labels(model, args, kwargs), exc)
            or next((h for key, h in _HINTS if key in str(exc)), None)
            or "run torch.export.export(model, args, kwargs, strict=False) to see the full error"
        )
        what = f"{type(model).__name__}{where}: {type(exc).__name__}: {message}"
        raise CaptureError(f"could not capture {what}. Try: {hint}.") from exc


def _refuse_recompute_not_run(model: torch.nn.Module, annotations: ModelAnnotations, ran: set[str]) -> None:
    """``recompute`` on a module whose forward never ran would recompute nothing (regions are the
    ops a module's forward records), so it is refused like ``in_strategy`` on such a module."""
    modules = dict(model.named_modules())
    for path in annotations.recompute:
        if path not in ran:
            raise AnnotationError(
                f"{describe_module(path, modules[path])}: recompute() is set on it, but its forward never "
                "runs (as module(...)) while the model is captured, so nothing would be recomputed; annotate "
                "modules that run (a ModuleList or ModuleDict has no forward: annotate each block it holds)"
            )


def _refuse_data_dependent_shapes(graph: torch.fx.Graph, model: str) -> None:
    """A plan is for static shapes: a value whose size depends on the data (a boolean mask's
    selection, ``nonzero``, ``unique``) cannot be split or priced, so capture stops there."""
    for node in graph.nodes:
        for v in output_values(node):
            if not all(isinstance(s, int) for s in v.shape):
                where = module_path(node) or "<root>"
                raise CaptureError(
                    f"{model}: op {node.target} in module '{where}' makes a tensor whose size depends on "
                    f"the data (shape {tuple(v.shape)}); autopar compiles static shapes. Try: keep the shape "
                    "static, e.g. a masked sum torch.where(mask, x, 0).sum() instead of x[mask].sum()"
                )


def gradient_flow(captured: Captured) -> dict[torch.fx.Node, bool]:
    """Which nodes carry a gradient: floating values computed from a parameter or input that needs
    one, other than through a ``detach``."""
    flows: dict[torch.fx.Node, bool] = {}
    for node in captured.graph.nodes:
        vals = output_values(node)
        floating = any(v.dtype.is_floating_point for v in vals)
        if node.op == "placeholder":
            flows[node] = captured.requires_grad.get(node.name, False) and floating
        elif node.op in ("call_function", "call_module"):  # call_module: a recompute region
            no_grad = bool(node.args) and node.args[0] is False and "set_grad_enabled" in str(node.target)
            no_grad = no_grad or node.target is torch.ops.aten.detach.default
            flows[node] = floating and not no_grad and any(flows.get(a, False) for a in node.all_input_nodes)
    return flows
