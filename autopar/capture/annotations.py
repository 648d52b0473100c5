"""User annotations on an ordinary ``nn.Module`` and their lowering to layouts.

Four annotations, recorded on the module and read by the capture step:

* :func:`shard` fixes strategies for a module's tensor inputs, outputs and parameters;
* :func:`constrain` fixes the layout of one intermediate tensor inside ``forward``;
* :func:`pipeline_stage` and :func:`recompute` mark modules for later passes.

A *strategy* gives one item per tensor dimension, either as slice counts
(MindSpore form, ``(2, 1)``) or as mesh-axis names (named form, ``("dp", None)``).
:func:`lower_strategy` turns it into a :data:`~autopar.ir.layout.Layout`.

Nothing here changes eager behaviour. Inside :func:`annotation_hooks` (the capture
step wraps ``torch.export.export`` in it) annotated tensors pass through the custom op
``autopar::layout_constraint``, which is a copy when run and a node carrying the
layout when exported. Every mistake raises :class:`~autopar.ir.errors.AnnotationError`
naming the module, the tensor and the dimension. See ``docs/annotations.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopar.ir.errors import AnnotationError
from autopar.ir.layout import REPLICATE, Layout, format_layout, parse_layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import POLICIES

AxisNames = str | tuple[str, ...] | None
"""One item of a named strategy: an axis, several axes (outer first), or None (not split)."""

Strategy = tuple[int, ...] | tuple[AxisNames, ...]
"""One item per tensor dimension: all slice counts, or all :data:`AxisNames`."""

ModuleT = TypeVar("ModuleT", bound=nn.Module)

Run = tuple[int, ...]  # indices of mesh axes splitting one dim, outer first

# Attribute names on annotated modules (or classes, for ``shard``). Attributes rather
# than a side registry so annotations follow the module through copy.deepcopy.
_SHARD_ATTR = "_autopar_shard"
_STAGE_ATTR = "_autopar_stage"
_RECOMPUTE_ATTR = "_autopar_recompute"

_EXAMPLE = "such as (2, 1) or ('dp', None)"


# --------------------------------------------------------------------------- strategies


def _is_count(item: object) -> bool:
    # bool is an int subclass, but True as a slice count is surely a mistake.
    return isinstance(item, int) and not isinstance(item, bool)


def _item_axes(item: AxisNames) -> tuple[str, ...]:
    if item is None:
        return ()
    return (item,) if isinstance(item, str) else item


def check_strategy_form(strategy: object, *, where: str) -> bool:
    """Check what needs neither mesh nor shape; return True for the integer form.

    Catches a non-tuple, items of the wrong type, counts below 1, forms mixed in one
    tuple, and one axis name used twice. An empty tuple (a 0-dim tensor) is named form.
    """
    if not isinstance(strategy, tuple):
        raise AnnotationError(
            f"{where}: a strategy must be a tuple with one item per tensor dimension, "
            f"{_EXAMPLE}; got {strategy!r}"
        )
    for d, item in enumerate(strategy):
        if _is_count(item):
            if item < 1:
                raise AnnotationError(
                    f"{where}: dim {d}: slice count {item} must be at least 1 (1 = not split)"
                )
        elif isinstance(item, tuple):
            if not item or not all(isinstance(n, str) for n in item):
                raise AnnotationError(
                    f"{where}: dim {d}: a tuple of mesh axis names must be non-empty and hold only "
                    f"names, got {item!r}"
                )
        elif item is not None and not isinstance(item, str):
            raise AnnotationError(
                f"{where}: dim {d}: {item!r} is none of: a slice count (int >= 1), a mesh axis "
                f"name (str), a tuple of names, None"
            )
    counts = [_is_count(item) for item in strategy]
    if any(counts) and not all(counts):
        raise AnnotationError(
            f"{where}: strategy {strategy!r} mixes slice counts with axis names; use one form, "
            f"all ints like (2, 1) or all names/None like ('dp', None)"
        )
    if any(counts):
        return True
    seen: dict[str, int] = {}
    for d, item in enumerate(strategy):
        for name in _item_axes(item):
            if name in seen:
                raise AnnotationError(
                    f"{where}: mesh axis {name!r} is used on dim {seen[name]} and dim {d}; "
                    f"an axis can split a tensor only once"
                )
            seen[name] = d
    return False


def _named_axes(strategy: Strategy, mesh: MeshSpec, where: str) -> list[Run]:
    axes = []
    for d, item in enumerate(strategy):
        names = _item_axes(item)
        for name in names:
            if name not in mesh.axis_names:
                raise AnnotationError(
                    f"{where}: dim {d}: unknown mesh axis {name!r}; the mesh has axes {list(mesh.axis_names)}"
                )
        indices = tuple(mesh.axis_names.index(n) for n in names)
        if list(indices) != sorted(indices):
            # DTensor's placements fix the order: the earlier mesh axis is the outer split.
            in_order = tuple(sorted(names, key=mesh.axis_names.index))
            raise AnnotationError(
                f"{where}: dim {d}: axes {names!r} are not in mesh order {list(mesh.axis_names)}; "
                f"the earlier mesh axis always takes the outer split, so write {in_order!r}"
            )
        axes.append(indices)
    return axes


def _runs(count: int, mesh: MeshSpec) -> list[Run]:
    """Runs of consecutive mesh axes, size-1 axes skipped, whose sizes multiply to ``count``."""
    axes = [i for i, s in enumerate(mesh.axis_sizes) if s > 1]
    runs = []
    for start in range(len(axes)):
        product = 1
        for stop in range(start, len(axes)):
            product *= mesh.axis_sizes[axes[stop]]
            if product == count:
                runs.append(tuple(axes[start : stop + 1]))
            if product >= count:
                break
    return runs


def _disjoint_choices(candidates: list[tuple[int, list[Run]]]) -> list[dict[int, Run]]:
    """Every way to give each dim one of its runs with no mesh axis used twice."""
    if not candidates:
        return [{}]
    (dim, runs), rest = candidates[0], candidates[1:]
    choices = []
    for run in runs:
        for tail in _disjoint_choices(rest):
            if not any(set(run) & set(other) for other in tail.values()):
                choices.append({dim: run, **tail})
    return choices


def _as_named(choice: dict[int, Run], ndim: int, mesh: MeshSpec) -> tuple[AxisNames, ...]:
    """The named-form strategy meaning ``choice`` (for messages)."""
    out: list[AxisNames] = []
    for d in range(ndim):
        names = tuple(mesh.axis_names[a] for a in choice.get(d, ()))
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return tuple(out)


def _axes_str(mesh: MeshSpec, axes: Sequence[int]) -> str:
    return ", ".join(f"{mesh.axis_names[a]}={mesh.axis_sizes[a]}" for a in axes)


def _counted_axes(strategy: tuple[int, ...], mesh: MeshSpec, where: str) -> list[Run]:
    total = math.prod(strategy)
    if mesh.size % total:
        raise AnnotationError(
            f"{where}: the counts of {strategy!r} multiply to {total}, which does not divide the "
            f"{mesh.size} devices of mesh {mesh}"
        )
    all_axes = range(mesh.ndim)
    candidates = []
    for d, count in enumerate(strategy):
        if count == 1:
            continue
        runs = _runs(count, mesh)
        if not runs:
            raise AnnotationError(
                f"{where}: count {count} on dim {d} is not expressible on mesh axes "
                f"{_axes_str(mesh, all_axes)}: a count must be the size of one axis or the product "
                f"of consecutive axes; use the named form to pick axes yourself"
            )
        candidates.append((d, runs))
    choices = _disjoint_choices(candidates)
    if not choices:
        options = "; ".join(
            f"dim {d} (count {strategy[d]}) could use only "
            + " or ".join(f"({_axes_str(mesh, run)})" for run in runs)
            for d, runs in candidates
        )
        raise AnnotationError(
            f"{where}: the counts of {strategy!r} cannot be given disjoint axes of mesh {mesh}: {options}"
        )
    if len(choices) > 1:
        options = " or ".join(repr(_as_named(c, len(strategy), mesh)) for c in choices)
        raise AnnotationError(
            f"{where}: strategy {strategy!r} is ambiguous on mesh {mesh}: it could mean {options}; "
            f"write the named form to choose one"
        )
    return [choices[0].get(d, ()) for d in range(len(strategy))]


def _strategy_axes(
    strategy: Strategy, mesh: MeshSpec, where: str, shape: Sequence[int] | None = None
) -> list[Run]:
    """Mesh axis indices splitting each dim, outer first; every check but divisibility.

    The rank is checked first when ``shape`` is given, as a wrong rank explains any later error.
    """
    is_counts = check_strategy_form(strategy, where=where)
    if shape is not None and len(strategy) != len(shape):
        raise AnnotationError(
            f"{where}: strategy {strategy!r} has {len(strategy)} items but the tensor has "
            f"{len(shape)} dims (shape {tuple(shape)}); give one item per dimension"
        )
    if is_counts:
        return _counted_axes(strategy, mesh, where)  # type: ignore[arg-type]
    return _named_axes(strategy, mesh, where)


def lower_strategy(strategy: Strategy, shape: Sequence[int], mesh: MeshSpec, *, where: str) -> Layout:
    """The layout meaning ``strategy`` for a tensor of ``shape`` on ``mesh``.

    Named form: ``Shard(d)`` on every axis named for dim ``d``, ``Replicate()`` on the
    others; the names of one dim must follow mesh order (DTensor: earlier axis = outer
    split). Integer form: each count > 1 goes to the unique set of disjoint runs of
    consecutive mesh axes with that size (see ``docs/annotations.md``). ``where``
    starts every error message. Symbolic sizes are not checked for divisibility.
    """
    layout = [REPLICATE] * mesh.ndim
    for d, axes in enumerate(_strategy_axes(strategy, mesh, where, shape)):
        parts = math.prod(mesh.axis_sizes[a] for a in axes)
        # A SymInt test would add a guard to the exported graph; leave those to run time.
        if isinstance(shape[d], int) and shape[d] % parts:
            raise AnnotationError(
                f"{where}: dim {d} has size {shape[d]}, which cannot be split into {parts} equal "
                f"parts (mesh axes {_axes_str(mesh, axes)})"
            )
        for a in axes:
            layout[a] = Shard(d)
    return tuple(layout)


# --------------------------------------------------------------------------- the custom op


@torch.library.custom_op("autopar::layout_constraint", mutates_args=())
def layout_constraint(x: torch.Tensor, spec: str) -> torch.Tensor:
    """``x`` must have the layout in ``spec`` (JSON, see :func:`parse_constraint_spec`).

    Eagerly a copy: a custom op may not return its input. Exported, a node the planner reads.
    """
    return x.clone()


@layout_constraint.register_fake
def _layout_constraint_fake(x: torch.Tensor, spec: str) -> torch.Tensor:
    return torch.empty_like(x)


def _layout_constraint_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


layout_constraint.register_autograd(_layout_constraint_backward)


def constraint_spec(layout: Layout | None, origin: str) -> str:
    """The ``spec`` string of a ``layout_constraint`` node: ``{"layout": "S(0)R", "origin": ...}``.

    A ``None`` layout (JSON ``null``) pins nothing: it marks a point where the solver
    may change the layout freely (autopar puts one at the input of every repeated block).
    """
    return json.dumps({"layout": None if layout is None else format_layout(layout), "origin": origin})


def parse_constraint_spec(spec: str) -> tuple[Layout | None, str]:
    """Inverse of :func:`constraint_spec`: the layout (``None`` if free) and the description of its origin."""
    try:
        data = json.loads(spec)
        layout = None if data["layout"] is None else parse_layout(data["layout"])
        return layout, str(data["origin"])
    except (ValueError, KeyError, TypeError) as e:
        raise AnnotationError(f"not a layout_constraint spec: {spec!r} ({e})") from None


# --------------------------------------------------------------------------- annotations


@dataclass(frozen=True)
class ShardAnnotation:
    """What :func:`shard` recorded. ``None`` entries are left to the solver.

    ``in_strategy``/``out_strategy`` hold one entry per tensor input/output (``None``:
    none given); ``parameter_plan`` holds ``(name relative to the module, strategy)``
    pairs in the order given.
    """

    in_strategy: tuple[Strategy | None, ...] | None = None
    out_strategy: tuple[Strategy | None, ...] | None = None
    parameter_plan: tuple[tuple[str, Strategy | None], ...] = ()


def _check_entries(entries: object, what: str, where: str) -> tuple[Strategy | None, ...] | None:
    if entries is None:
        return None
    if not isinstance(entries, tuple):
        raise AnnotationError(f"{where}: {what} must be a tuple with one strategy (or None) per tensor")
    for i, strategy in enumerate(entries):
        if strategy is None:
            continue
        if not isinstance(strategy, tuple):
            # Most likely a lone strategy such as in_strategy=(2, 1) for a one-input module.
            raise AnnotationError(
                f"{where}: {what} entry {i} is {strategy!r}, not a strategy tuple or None; {what} "
                f"holds one strategy per tensor, e.g. {what}=((2, 1),) for a single tensor"
            )
        check_strategy_form(strategy, where=f"{where} {what} entry {i}")
    return entries


def _check_plan(plan: object, where: str) -> tuple[tuple[str, Strategy | None], ...]:
    if plan is None:
        return ()
    if not isinstance(plan, Mapping):
        raise AnnotationError(f"{where}: parameter_plan must be a mapping {{param_name: strategy}}")
    for name, strategy in plan.items():
        if not isinstance(name, str):
            raise AnnotationError(f"{where}: parameter_plan key {name!r} is not a parameter name (str)")
        if strategy is not None:
            check_strategy_form(strategy, where=f"{where} parameter_plan[{name!r}]")
    return tuple(plan.items())


def _attach(target: object, annotation: ShardAnnotation) -> Any:
    if isinstance(target, nn.Module) or (isinstance(target, type) and issubclass(target, nn.Module)):
        setattr(target, _SHARD_ATTR, annotation)
        return target
    raise AnnotationError(f"shard() takes an nn.Module instance or subclass, got {target!r}")


def shard(
    target: Any = None,
    /,
    *,
    in_strategy: tuple[Strategy | None, ...] | None = None,
    out_strategy: tuple[Strategy | None, ...] | None = None,
    parameter_plan: Mapping[str, Strategy | None] | None = None,
) -> Any:
    """Record strategies for a module's tensor inputs, outputs and parameters.

    ``target`` an instance: annotate it and return it. ``target`` an ``nn.Module``
    subclass: annotate every instance (of it and its subclasses; an instance's own
    annotation wins) and return the class. ``target`` omitted: return a decorator.
    A later call replaces an earlier one on the same target. Only the forms are
    checked here; mesh and shape checks come at capture.
    """
    if target is None:
        where = "shard()"
    else:
        where = f"shard() on {target.__name__ if isinstance(target, type) else type(target).__name__}"
    annotation = ShardAnnotation(
        in_strategy=_check_entries(in_strategy, "in_strategy", where),
        out_strategy=_check_entries(out_strategy, "out_strategy", where),
        parameter_plan=_check_plan(parameter_plan, where),
    )
    if in_strategy is None and out_strategy is None and not annotation.parameter_plan:
        raise AnnotationError(f"{where}: give at least one of in_strategy, out_strategy, parameter_plan")
    if target is None:
        return lambda t: _attach(t, annotation)
    return _attach(target, annotation)


def shard_annotation(module: nn.Module) -> ShardAnnotation | None:
    """The annotation in force for ``module``: its own, else its class's, else None."""
    return getattr(module, _SHARD_ATTR, None)


def _require_module(module: object, fn: str) -> None:
    if not isinstance(module, nn.Module):
        raise AnnotationError(f"{fn}() takes an nn.Module instance, got {module!r}")


def pipeline_stage(module: ModuleT, k: int) -> ModuleT:
    """Record that ``module`` runs in pipeline stage ``k`` (0, 1, ...); return ``module``.

    A module belongs to one stage: giving it another stage later is an error (giving
    the same one again is not).
    """
    _require_module(module, "pipeline_stage")
    if not _is_count(k) or k < 0:
        raise AnnotationError(
            f"pipeline_stage() on {type(module).__name__}: stage must be a non-negative int, got {k!r}"
        )
    earlier = vars(module).get(_STAGE_ATTR)
    if earlier is not None and earlier != k:
        raise AnnotationError(
            f"pipeline_stage() on {type(module).__name__}: the module is already in stage {earlier}, so it "
            f"cannot be in stage {k} too; a module runs in one stage"
        )
    setattr(module, _STAGE_ATTR, k)
    return module


def recompute(module: ModuleT, policy: str = "full") -> ModuleT:
    """Recompute ``module``'s activations in backward instead of keeping them; return ``module``.

    MindSpore's rule: the module's outputs are kept, everything it computes inside is
    recomputed. ``policy="selective"`` keeps the outputs of its matrix products and
    attention too and recomputes only the cheap ops. Communication is never repeated
    (collective outputs are kept), except gathers of ZeRO-3 parameters.
    """
    _require_module(module, "recompute")
    if policy not in POLICIES:
        raise AnnotationError(
            f"recompute({type(module).__name__}, policy={policy!r}): the policy is one of {list(POLICIES)}"
        )
    setattr(module, _RECOMPUTE_ATTR, policy)
    return module


# --------------------------------------------------------------------------- model-wide view


@dataclass(frozen=True)
class ModelAnnotations:
    """The model-wide annotations, validated against one mesh (read-only mappings).

    ``parameter_layouts`` is keyed by fqn as in ``model.named_parameters()`` (tied
    weights under their first name); ``stages`` and ``recompute`` by module path as
    in ``model.named_modules()`` ("" is the root).
    """

    parameter_layouts: Mapping[str, Layout]
    stages: Mapping[str, int]
    recompute: Mapping[str, str]  # module path -> policy


def _describe(path: str, module: nn.Module) -> str:
    cls = type(module).__name__
    return f"the root module ({cls})" if path == "" else f"module {path!r} ({cls})"


def _is_ancestor(outer: str, inner: str) -> bool:
    return outer != inner and (outer == "" or inner.startswith(outer + "."))


def _parameter(module: nn.Module, name: str, desc: str) -> nn.Parameter:
    try:
        return module.get_parameter(name)
    except AttributeError:
        known = [n for n, _ in module.named_parameters()]
        raise AnnotationError(
            f"{desc}: parameter_plan names parameter {name!r}, which it does not have; its parameters "
            f"are {known}"
        ) from None


def collect_annotations(model: nn.Module, mesh: MeshSpec | Mapping[str, int]) -> ModelAnnotations:
    """Validate every annotation under ``model`` against ``mesh`` and gather them.

    Parameter strategies are fully checked (name, rank, divisibility, one layout per
    tied parameter); input/output strategies are checked against the mesh only, since
    their shapes are known at capture. Stages must be 0..N without gaps and agree
    along nesting; ``recompute`` may be set at most once along any chain of nesting.
    """
    mesh = MeshSpec.of(mesh)
    fqn_of = {id(p): name for name, p in model.named_parameters()}
    layouts: dict[str, Layout] = {}
    layout_origin: dict[str, str] = {}
    stages: dict[str, int] = {}
    recomputed: dict[str, str] = {}
    modules = dict(model.named_modules())
    for path, module in modules.items():
        desc = _describe(path, module)
        annotation = shard_annotation(module)
        if annotation is not None:
            for what, entries in (("input", annotation.in_strategy), ("output", annotation.out_strategy)):
                for i, strategy in enumerate(entries or ()):
                    if strategy is not None:
                        _strategy_axes(strategy, mesh, f"{desc} {what} {i}")
            for name, strategy in annotation.parameter_plan:
                param = _parameter(module, name, desc)
                if strategy is None:
                    continue
                where = f"{desc} parameter {name!r}"
                layout = lower_strategy(strategy, tuple(param.shape), mesh, where=where)
                fqn = fqn_of[id(param)]
                if fqn in layouts and layouts[fqn] != layout:
                    raise AnnotationError(
                        f"{where}: parameter {fqn!r} gets layout {format_layout(layout)} here but "
                        f"{format_layout(layouts[fqn])} from {layout_origin[fqn]}; tied parameters "
                        f"need one layout"
                    )
                layouts[fqn], layout_origin[fqn] = layout, where
        if _STAGE_ATTR in vars(module):
            stages[path] = vars(module)[_STAGE_ATTR]
        if vars(module).get(_RECOMPUTE_ATTR):
            recomputed[path] = vars(module)[_RECOMPUTE_ATTR]
    _check_stages(stages, modules)
    for outer in recomputed:
        for inner in recomputed:
            if _is_ancestor(outer, inner):
                raise AnnotationError(
                    f"recompute() is set on {_describe(outer, modules[outer])} and on "
                    f"{_describe(inner, modules[inner])} inside it; set it at most once along a hierarchy"
                )
    return ModelAnnotations(MappingProxyType(layouts), MappingProxyType(stages), MappingProxyType(recomputed))


def _check_stages(stages: dict[str, int], modules: dict[str, nn.Module]) -> None:
    if not stages:
        return
    missing = sorted(set(range(max(stages.values()) + 1)) - set(stages.values()))
    if missing:
        given = ", ".join(f"{path or '<root>'}={k}" for path, k in stages.items())
        raise AnnotationError(
            f"pipeline stages must be numbered 0, 1, ... without gaps; missing {missing} (given: {given})"
        )
    for outer, k in stages.items():
        for inner, j in stages.items():
            if _is_ancestor(outer, inner) and j != k:
                raise AnnotationError(
                    f"pipeline_stage: {_describe(inner, modules[inner])} is in stage {j} but sits inside "
                    f"{_describe(outer, modules[outer])} in stage {k}"
                )


# --------------------------------------------------------------------------- capture


@dataclass
class _Capture:
    mesh: MeshSpec
    # (module, description) of the modules whose forward is running, innermost last.
    stack: list[tuple[nn.Module, str]]


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("autopar_capture", default=None)


def _constrained(tensor: torch.Tensor, strategy: Strategy, mesh: MeshSpec, where: str) -> torch.Tensor:
    layout = lower_strategy(strategy, tuple(tensor.shape), mesh, where=where)
    return torch.ops.autopar.layout_constraint(tensor, constraint_spec(layout, where))


def constrain(tensor: torch.Tensor, strategy: Strategy) -> torch.Tensor:
    """Require ``tensor`` to have the layout of ``strategy`` at this point of ``forward``.

    Outside a capture this returns ``tensor`` itself. During one it returns
    ``layout_constraint(tensor, spec)``, after checking the strategy against the mesh
    and the tensor's shape.
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
    capture = _Capture(mesh, [])
    handles: list[Any] = []
    token = _ACTIVE.set(capture)
    try:
        for path, module in model.named_modules():
            handles += _install_hooks(module, _describe(path, module), capture)
        yield annotations
    finally:
        for handle in handles:
            handle.remove()
        _ACTIVE.reset(token)


__all__ = [
    "AxisNames",
    "ModelAnnotations",
    "ShardAnnotation",
    "Strategy",
    "annotation_hooks",
    "check_strategy_form",
    "collect_annotations",
    "constrain",
    "constraint_spec",
    "layout_constraint",
    "lower_strategy",
    "parse_constraint_spec",
    "pipeline_stage",
    "recompute",
    "shard",
    "shard_annotation",
]
