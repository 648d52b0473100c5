"""What annotations do while a model is captured: :func:`annotation_hooks` and :func:`constrain`.

Inside :func:`annotation_hooks` (the capture step wraps ``torch.export.export`` in it)
the tensor inputs and outputs that :func:`~autopar.capture.annotations.shard` names pass
through the custom op ``autopar::layout_constraint``
(:mod:`autopar.capture.constraint_op`), a copy when run and a node carrying the layout
when exported, and :func:`constrain` does the same for the tensor it is given. Outside,
nothing happens: ``constrain`` returns its tensor. ``constrain`` lives here, not with the
other annotations, because it reads the capture state that :func:`annotation_hooks` sets.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture.annotations import (
    ModelAnnotations,
    annotations_on,
    collect_annotations,
    describe_module,
    shard_annotation,
)
from autopar.capture.constraint_op import constraint_spec, layout_constraint
from autopar.capture.strategies import Strategy, lower_strategy
from autopar.ir.errors import AnnotationError
from autopar.ir.mesh import MeshSpec


@dataclass
class _Capture:
    """The capture in progress (captures do not nest)."""

    mesh: MeshSpec
    # (module, description) of the modules whose forward is running, innermost last.
    stack: list[tuple[nn.Module, str]]
    # the modules whose forward ran
    ran: set[int] = field(default_factory=set)


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("autopar_capture", default=None)


def _constrained(tensor: torch.Tensor, strategy: Strategy, mesh: MeshSpec, where: str) -> torch.Tensor:
    layout = lower_strategy(strategy, tuple(tensor.shape), mesh, where=where)
    return layout_constraint(tensor, constraint_spec(layout, where))


def constrain(tensor: torch.Tensor, strategy: Strategy) -> torch.Tensor:
    """Require ``tensor`` to have the layout of ``strategy`` at this point of ``forward``.

    Outside a capture this returns ``tensor`` itself. During one it returns
    ``layout_constraint(tensor, spec)``, after checking the strategy against the mesh
    and the tensor's shape.

    Args:
        tensor: a tensor computed in ``forward``.
        strategy: its layout, as ``shard``'s strategies are written (split counts or axis names).

    Returns:
        ``tensor`` outside a capture, else the constrained value to use in its place.

    Raises:
        AnnotationError: ``tensor`` not a tensor, or a strategy the mesh or its shape cannot take.
    """
    capture = _ACTIVE.get()
    if capture is None:
        return tensor
    caller = inspect.currentframe().f_back  # type: ignore[union-attr]
    site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"  # type: ignore[union-attr]
    where = f"constrain() in {capture.stack[-1][1]} at {site}" if capture.stack else f"constrain() at {site}"
    if not isinstance(tensor, torch.Tensor):
        raise AnnotationError(f"{where}: expected a tensor, got {type(tensor).__name__}")
    return _constrained(tensor, strategy, capture.mesh, where)


def _tensor_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[inspect.BoundArguments, list]:
    """Bound arguments and ``(label, parameter name, key)`` of each tensor input in signature order.

    ``key`` is None for a plain parameter, else the index or name inside ``*args``/``**kwargs``.
    """
    signature = inspect.signature(module.forward)
    bound = signature.bind(*args, **kwargs)
    slots: list[tuple[str, str, int | str | None]] = []
    for pname, value in bound.arguments.items():
        kind = signature.parameters[pname].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            slots += [(f"{pname}[{i}]", pname, i) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            slots += [(k, pname, k) for k, v in value.items() if isinstance(v, torch.Tensor)]
        elif isinstance(value, torch.Tensor):
            slots.append((pname, pname, None))
    return bound, slots


def _check_count(entries: tuple, found: int, field: str, tensors: str, desc: str) -> None:
    if len(entries) != found:
        raise AnnotationError(
            f"{desc}: len({field}) is {len(entries)} but forward got {found} {tensors}; give one "
            f"strategy (or None) per tensor"
        )


def _wrap_inputs(
    module: nn.Module, desc: str, entries: tuple, mesh: MeshSpec, args: tuple, kwargs: dict
) -> Any:
    try:
        bound, slots = _tensor_inputs(module, args, kwargs)
    except TypeError:
        return None  # the call does not fit forward's signature; let forward report it
    labels = ", ".join(slot[0] for slot in slots)
    _check_count(entries, len(slots), "in_strategy", f"tensor inputs ({labels})", desc)
    for i, ((label, pname, key), strategy) in enumerate(zip(slots, entries, strict=True)):
        if strategy is None:
            continue
        where = f"{desc} input {i} ({label})"
        if key is None:
            bound.arguments[pname] = _constrained(bound.arguments[pname], strategy, mesh, where)
        elif isinstance(key, int):
            items = list(bound.arguments[pname])
            items[key] = _constrained(items[key], strategy, mesh, where)
            bound.arguments[pname] = tuple(items)
        else:
            values = dict(bound.arguments[pname])
            values[key] = _constrained(values[key], strategy, mesh, where)
            bound.arguments[pname] = values
    return bound.args, bound.kwargs


def _wrap_outputs(desc: str, entries: tuple, mesh: MeshSpec, output: Any) -> Any:
    leaves, spec = pytree.tree_flatten(output)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    _check_count(entries, len(positions), "out_strategy", "tensor outputs", desc)
    for k, (i, strategy) in enumerate(zip(positions, entries, strict=True)):
        if strategy is not None:
            leaves[i] = _constrained(leaves[i], strategy, mesh, f"{desc} output {k}")
    return pytree.tree_unflatten(leaves, spec)


def _install_hooks(module: nn.Module, desc: str, capture: _Capture) -> list[Any]:
    annotation = shard_annotation(module)
    inputs = annotation.in_strategy if annotation else None
    outputs = annotation.out_strategy if annotation else None

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
        capture.stack.append((mod, desc))
        capture.ran.add(id(mod))
        return None if inputs is None else _wrap_inputs(mod, desc, inputs, capture.mesh, args, kwargs)

    def wrap(mod: nn.Module, args: tuple, output: Any) -> Any:
        return _wrap_outputs(desc, outputs, capture.mesh, output)  # type: ignore[arg-type]

    def leave(mod: nn.Module, args: tuple, output: Any) -> None:
        # Runs even when forward raised (always_call); pop only our own entry, since an
        # earlier pre-hook may have raised before ``enter`` pushed it.
        if capture.stack and capture.stack[-1][0] is mod:
            capture.stack.pop()

    handles = [module.register_forward_pre_hook(enter, with_kwargs=True)]
    if outputs is not None:
        handles.append(module.register_forward_hook(wrap))
    handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


@contextlib.contextmanager
def annotation_hooks(model: nn.Module, mesh: MeshSpec | Mapping[str, int]) -> Iterator[ModelAnnotations]:
    """Make ``model``'s annotations visible to a capture (``torch.export.export``) inside.

    Yields :func:`collect_annotations` ``(model, mesh)``. Until exit, annotated tensor
    inputs and outputs pass through ``layout_constraint`` (their count, rank and
    divisibility checked on each call) and :func:`constrain` is live. On exit, also on
    error, all hooks are removed and ``constrain`` is a no-op again.
    """
    mesh = MeshSpec.of(mesh)
    if _ACTIVE.get() is not None:
        raise AnnotationError("annotation_hooks() is already active; captures cannot be nested")
    annotations = collect_annotations(model, mesh)
    capture = _Capture(mesh=mesh, stack=[])
    handles: list[Any] = []
    token = _ACTIVE.set(capture)
    try:
        for path, module in model.named_modules():
            handles += _install_hooks(module, describe_module(path, module), capture)
        handles.append(_refuse_unregistered(model))
        yield annotations
    finally:
        for handle in handles:
            handle.remove()
        _ACTIVE.reset(token)


def _refuse_unregistered(model: nn.Module) -> Any:
    """A global hook refusing an annotated module that runs in ``model``'s forward without
    being one of its modules: its annotations would be ignored without a word."""
    registered = {id(m) for m in model.modules()}

    def check(module: nn.Module, args: tuple) -> None:
        kinds = annotations_on(module)
        if kinds and id(module) not in registered:
            raise AnnotationError(
                f"a {type(module).__name__} module annotated with {' and '.join(kinds)} runs in the "
                f"forward of {type(model).__name__} but is not one of its modules (held in a plain "
                "list, dict or non-Module attribute?), so its annotations cannot apply; hold it in "
                "an nn.Module attribute, nn.ModuleList or nn.ModuleDict"
            )

    return torch.nn.modules.module.register_module_forward_pre_hook(check)


def check_strategies_ran(model: nn.Module) -> None:
    """After a capture inside :func:`annotation_hooks`: ``in_strategy``/``out_strategy`` on a
    module whose forward never ran would do nothing, so they are refused."""
    capture = _ACTIVE.get()
    assert capture is not None, "check_strategies_ran() runs inside annotation_hooks()"
    for path, module in model.named_modules():
        annotation = shard_annotation(module)
        given = annotation is not None and (annotation.in_strategy, annotation.out_strategy) != (None, None)
        if given and id(module) not in capture.ran:
            raise AnnotationError(
                f"{describe_module(path, module)}: shard() gives in_strategy/out_strategy, but its "
                "forward never ran while the model was captured, so they would do nothing; annotate "
                "a module that runs (parameter_plan alone needs no call)"
            )
