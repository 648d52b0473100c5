"""User annotations on an ordinary ``nn.Module``, and their model-wide view.

Three annotations are recorded on the modules themselves:

* :func:`shard` fixes strategies (see :mod:`autopar.capture.strategies`) for a module's
  tensor inputs, outputs and parameters. As in MindSpore, a parameter's strategy is the
  layout its ops compute with (``parameter_plan``: Megatron's column/row-parallel when
  written so); ``parameter_storage`` pins only how a parameter is stored, its ops taking
  it in whatever layout the planner picks (gathered for use: ZeRO-3/FSDP style);
* :func:`pipeline_stage` and :func:`recompute` mark modules for later passes.

The fourth, :func:`~autopar.capture.hooks.constrain`, sits inside ``forward`` and acts
only while a model is captured. :func:`collect_annotations` validates all of a model's
annotations against a mesh. Nothing here changes eager behaviour; every mistake raises
:class:`~autopar.ir.errors.AnnotationError` naming the module, the tensor and the dimension.
See ``docs/annotations.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeVar

from torch import nn
from torch.distributed.tensor import Replicate
from torch.nn.modules.module import register_module_module_registration_hook

from autopar.capture.strategies import (
    ManualSplit,
    Parts,
    Strategy,
    check_strategy_form,
    is_plain_int,
    lower_strategy,
    manual_rows,
    strategy_axes,
    unequal_parts,
)
from autopar.ir.errors import AnnotationError
from autopar.ir.layout import Layout, ManualRows, format_layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import POLICIES, RecomputePolicy

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# Attribute names on annotated modules (or classes, for ``shard``). Attributes rather
# than a side registry so annotations follow the module through copy.deepcopy.
_SHARD_ATTR = "_autopar_shard"
_STAGE_ATTR = "_autopar_stage"
_RECOMPUTE_ATTR = "_autopar_recompute"


@dataclass(frozen=True)
class ShardAnnotation:
    """What :func:`shard` recorded. ``None`` entries are left to the solver.

    ``in_strategy``/``out_strategy`` hold one entry per tensor input/output (``None``:
    none given); ``parameter_plan`` (compute layouts) and ``parameter_storage`` (storage
    only) hold ``(name relative to the module, strategy)`` pairs in the order given.
    """

    in_strategy: tuple[Strategy | None, ...] | None = None
    out_strategy: tuple[Strategy | None, ...] | None = None
    parameter_plan: tuple[tuple[str, Strategy | None], ...] = ()
    parameter_storage: tuple[tuple[str, Strategy | None], ...] = ()


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


def _check_plan(plan: object, what: str, where: str) -> tuple[tuple[str, Strategy | None], ...]:
    if plan is None:
        return ()
    if not isinstance(plan, Mapping):
        raise AnnotationError(f"{where}: {what} must be a mapping {{param_name: strategy}}")
    for name, strategy in plan.items():
        if not isinstance(name, str):
            raise AnnotationError(f"{where}: {what} key {name!r} is not a parameter name (str)")
        if strategy is not None:
            check_strategy_form(strategy, where=f"{where} {what}[{name!r}]")
    return tuple(plan.items())


# modules annotated since a capture last looked (weakly held, with the call that annotated them)
_ANNOTATED: list[tuple[weakref.ref, str]] = []


@dataclass(frozen=True)
class _Replaced:
    """An annotated module that ``parent.<name> = ...`` replaced by another (weakly held)."""

    parent: weakref.ref
    name: str
    module: weakref.ref
    what: str  # the annotated module's class and annotations, in words


# modules replaced after they were annotated, while their parents live (see _note_replacement)
_REPLACED: list[_Replaced] = []
_WATCHING: list[Any] = []  # the module registration hook, once the first annotation installs it


def _own_annotations(module: nn.Module) -> list[str]:
    """The annotations made on ``module`` itself (not on its class), by the name of their call."""
    calls = {"shard": _SHARD_ATTR, "pipeline_stage": _STAGE_ATTR, "recompute": _RECOMPUTE_ATTR}
    return [call for call, attr in calls.items() if attr in vars(module)]


def _note_replacement(parent: nn.Module, name: str, child: nn.Module) -> None:
    """A registration hook of every module: ``parent.<name> = child`` replacing an annotated module
    is noted, for :func:`unclaimed_annotations` to refuse the annotation it would lose."""
    old = parent._modules.get(name)
    calls = [] if old is None or old is child else _own_annotations(old)
    if calls:
        _REPLACED[:] = [r for r in _REPLACED if r.parent() is not None]
        what = f"a {type(old).__name__} annotated with {' and '.join(calls)}"
        _REPLACED.append(_Replaced(weakref.ref(parent), name, weakref.ref(old), what))


def _noted(module: nn.Module, call: str) -> None:
    """Remember that ``call`` annotated ``module``, and watch for modules replaced once annotated."""
    _ANNOTATED.append((weakref.ref(module), call))
    if not _WATCHING:
        _WATCHING.append(register_module_module_registration_hook(_note_replacement))


def _refuse_replaced(model: nn.Module) -> None:
    """Raise for an annotated module of ``model`` that was replaced since it was annotated."""
    paths = {id(m): path for path, m in model.named_modules()}
    for noted in list(_REPLACED):
        parent, old = noted.parent(), noted.module()
        now = None if parent is None else parent._modules.get(noted.name)
        if parent is None or id(parent) not in paths or now is None or old is now:
            continue
        if _own_annotations(now) or (old is not None and id(old) in paths):
            continue  # the new module is annotated itself, or the old one still runs elsewhere
        path = f"{paths[id(parent)]}.{noted.name}".lstrip(".")
        raise AnnotationError(
            f"module {path!r} was {noted.what}, then replaced by a {type(now).__name__}, so the "
            f"annotated module is no longer part of the {type(model).__name__} and its annotation would "
            f"be lost; annotate the module now at {path!r} (or replace the module before annotating it)"
        )


def unclaimed_annotations(model: nn.Module) -> list[str]:
    """In words, the annotations made since the last capture on modules that are not part of
    ``model`` (which does not apply them); each is said once.

    Raises ``AnnotationError`` for an annotated module of ``model`` that was replaced by another
    since (``model.layer = nn.Linear(...)``): its annotation is lost, not merely elsewhere.
    """
    _refuse_replaced(model)
    mine = {id(m) for m in model.modules()}
    found = []
    for ref, call in _ANNOTATED:
        module = ref()
        if module is not None and id(module) not in mine:
            found.append(
                f"{call}() on a {type(module).__name__} module that is not part of the "
                f"{type(model).__name__} being planned is not applied to it"
            )
    _ANNOTATED.clear()
    return list(dict.fromkeys(found))


def _attach(target: object, annotation: ShardAnnotation) -> Any:
    if isinstance(target, nn.Module):
        _noted(target, "shard")
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
    parameter_storage: Mapping[str, Strategy | None] | None = None,
) -> Any:
    """Record strategies for a module's tensor inputs, outputs and parameters.

    ``parameter_plan`` gives the layout each named parameter is stored in *and* computed
    with: every op reading it takes it so (no gather). ``parameter_storage`` gives only
    how a parameter is stored; its ops may take it in other layouts (all-gathered for use).

    ``target`` an instance: annotate it and return it. ``target`` an ``nn.Module``
    subclass: annotate every instance (of it and its subclasses; an instance's own
    annotation wins) and return the class. ``target`` omitted: return a decorator.
    A later call replaces an earlier one on the same target. Only the forms are
    checked here; mesh and shape checks come at capture.

    Args:
        target: an ``nn.Module`` instance or subclass to annotate, or omitted for a decorator.
        in_strategy: one strategy per tensor input of ``forward`` (``None``: that input free).
        out_strategy: one strategy per tensor output (``None``: that output free).
        parameter_plan: parameter name -> the layout it is stored and computed in.
        parameter_storage: parameter name -> the layout it is stored in only.

    Returns:
        ``target`` (instance or class), or a decorator when ``target`` is omitted.

    Raises:
        AnnotationError: a form that is not a strategy, a parameter in both plans, or no strategy at all.
    """
    if target is None:
        where = "shard()"
    else:
        where = f"shard() on {target.__name__ if isinstance(target, type) else type(target).__name__}"
    annotation = ShardAnnotation(
        in_strategy=_check_entries(in_strategy, "in_strategy", where),
        out_strategy=_check_entries(out_strategy, "out_strategy", where),
        parameter_plan=_check_plan(parameter_plan, "parameter_plan", where),
        parameter_storage=_check_plan(parameter_storage, "parameter_storage", where),
    )
    both = {n for n, _ in annotation.parameter_plan} & {n for n, _ in annotation.parameter_storage}
    if both:
        raise AnnotationError(
            f"{where}: parameters {sorted(both)} are in both parameter_plan (compute layout) and "
            "parameter_storage (storage only); give each in one"
        )
    if (
        in_strategy is None
        and out_strategy is None
        and not annotation.parameter_plan
        and not annotation.parameter_storage
    ):
        raise AnnotationError(
            f"{where}: give at least one of in_strategy, out_strategy, parameter_plan, parameter_storage"
        )
    if target is None:
        return lambda t: _attach(t, annotation)
    return _attach(target, annotation)


def shard_annotation(module: nn.Module) -> ShardAnnotation | None:
    """The annotation in force for ``module``: its own, else its class's, else None."""
    return getattr(module, _SHARD_ATTR, None)


def annotations_on(module: nn.Module) -> list[str]:
    """The annotations ``module`` carries (its class's ``shard`` too), by the name of the call that
    made them."""
    own = _own_annotations(module)
    return ["shard"] * (shard_annotation(module) is not None and "shard" not in own) + own


def _require_module(module: object, fn: str) -> None:
    if not isinstance(module, nn.Module):
        raise AnnotationError(f"{fn}() takes an nn.Module instance, got {module!r}")


def pipeline_stage(module: ModuleT, k: int) -> ModuleT:
    """Record that ``module`` runs in pipeline stage ``k`` (0, 1, ...); return ``module``.

    A module belongs to one stage: giving it another stage later is an error (giving
    the same one again is not).

    Args:
        module: the module instance whose forward runs in the stage.
        k: the stage, a non-negative int.

    Raises:
        AnnotationError: ``module`` not a module, ``k`` not a non-negative int, or another stage given.
    """
    _require_module(module, "pipeline_stage")
    if not is_plain_int(k) or k < 0:
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
    _noted(module, "pipeline_stage")
    return module


def recompute(module: ModuleT, policy: RecomputePolicy | str = RecomputePolicy.FULL) -> ModuleT:
    """Recompute ``module``'s activations in backward instead of keeping them; return ``module``.

    MindSpore's rule: the module's outputs are kept, everything it computes inside is
    recomputed. ``"full"`` keeps the outputs of the collectives inside it (communication is not
    repeated, but for gathers of ZeRO-3 parameters); ``"selective"`` keeps the outputs of its
    matrix products and attention too and recomputes only the cheap ops; ``"full-comm"`` keeps
    only the module's inputs and runs its collectives again in backward (MindSpore's
    ``mp_comm_recompute=True``, Megatron-LM's full recompute). ``docs/memory.md`` has the table.

    Args:
        module: the module instance to recompute.
        policy: ``"full"`` (the default), ``"selective"`` or ``"full-comm"``.

    Raises:
        AnnotationError: ``module`` not a module, or another policy.
    """
    _require_module(module, "recompute")
    if policy not in POLICIES:
        raise AnnotationError(
            f"recompute({type(module).__name__}, policy={policy!r}): the policy is one of {list(POLICIES)}"
        )
    setattr(module, _RECOMPUTE_ATTR, RecomputePolicy(policy))
    _noted(module, "recompute")
    return module


# --------------------------------------------------------------------------- model-wide view


@dataclass(frozen=True)
class ModelAnnotations:
    """The model-wide annotations, validated against one mesh (read-only mappings).

    ``parameter_layouts`` (how parameters are stored) is keyed by fqn as in
    ``model.named_parameters()`` (tied weights under their first name; a capture keys them under
    every name, :func:`under_every_name`); those in
    ``compute_layouts`` are also the layouts their ops compute with. ``stages`` and
    ``recompute`` are keyed by module path as in ``model.named_modules()`` ("" is the root).
    """

    parameter_layouts: Mapping[str, Layout]
    compute_layouts: frozenset[str]
    stages: Mapping[str, int]
    recompute: Mapping[str, RecomputePolicy]  # module path -> policy
    # fqn -> the rows per rank of its ManualSplit
    parameter_rows: Mapping[str, ManualRows] = field(default_factory=lambda: MappingProxyType({}))
    # fqn -> the dim and Parts of unequal sizes its parameter_plan gives (each part's slice laid out)
    parameter_parts: Mapping[str, tuple[int, Parts]] = field(default_factory=lambda: MappingProxyType({}))


def under_every_name(annotations: ModelAnnotations, aliases: Mapping[str, list[str]]) -> ModelAnnotations:
    """``annotations`` with each parameter's entries under every name it has (``aliases``: a name ->
    all names of its tensor). A tied weight is annotated under its first name, while export may give
    the placeholder its ops read another (GPT-2's ``lm_head.weight`` for ``transformer.wte.weight``)."""

    def spread(table: Mapping[str, Any]) -> Mapping[str, Any]:
        return MappingProxyType({alias: v for fqn, v in table.items() for alias in aliases.get(fqn, [fqn])})

    return replace(
        annotations,
        parameter_layouts=spread(annotations.parameter_layouts),
        compute_layouts=frozenset(spread(dict.fromkeys(annotations.compute_layouts))),
        parameter_rows=spread(annotations.parameter_rows),
        parameter_parts=spread(annotations.parameter_parts),
    )


def describe_module(path: str, module: nn.Module) -> str:
    """How messages name the module at ``path``: ``module 'h.0' (Block)`` or ``the root module (GPT)``."""
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
    rows: dict[str, ManualRows] = {}
    parts: dict[str, tuple[int, Parts]] = {}
    computed_with: set[str] = set()
    stages: dict[str, int] = {}
    recomputed: dict[str, RecomputePolicy] = {}
    modules = dict(model.named_modules())
    for path, module in modules.items():
        desc = describe_module(path, module)
        annotation = shard_annotation(module)
        if annotation is not None:
            for what, entries in (("input", annotation.in_strategy), ("output", annotation.out_strategy)):
                for i, strategy in enumerate(entries or ()):
                    if strategy is not None:
                        strategy_axes(strategy, mesh, where=f"{desc} {what} {i}")
            pinned = [(n, st, True) for n, st in annotation.parameter_plan]
            for name, strategy, computed in pinned + [
                (n, st, False) for n, st in annotation.parameter_storage
            ]:
                param = _parameter(module, name, desc)
                if strategy is None:
                    continue
                where = f"{desc} parameter {name!r}"
                layout = lower_strategy(
                    strategy, tuple(param.shape), mesh, where=where, uneven=True, manual=computed
                )
                if unequal_parts(strategy) is not None:
                    parts[fqn_of[id(param)]] = _parts_alone(strategy, layout, where)
                    continue
                if computed:
                    computed_with.add(fqn_of[id(param)])
                fqn, manual = fqn_of[id(param)], manual_rows(strategy)
                if manual is not None:
                    _refuse_tied_rows(model, param, f"{path}.{name}".lstrip("."), strategy, where)
                if fqn in layouts and rows.get(fqn) != manual:
                    raise AnnotationError(
                        f"{where}: parameter {fqn!r} gets ManualSplit {manual} here but "
                        f"{rows.get(fqn)} from {layout_origin[fqn]}; tied parameters need one split"
                    )
                if manual is not None:
                    rows[fqn] = manual
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
                    f"recompute() is set on {describe_module(outer, modules[outer])} and on "
                    f"{describe_module(inner, modules[inner])} inside it; set it at most once along a "
                    f"hierarchy"
                )
    return ModelAnnotations(
        parameter_layouts=MappingProxyType(layouts),
        compute_layouts=frozenset(computed_with),
        stages=MappingProxyType(stages),
        recompute=MappingProxyType(recomputed),
        parameter_rows=MappingProxyType(rows),
        parameter_parts=MappingProxyType(parts),
    )


def _refuse_tied_rows(
    model: nn.Module, param: nn.Parameter, own: str, strategy: Strategy, where: str
) -> None:
    """A ``ManualSplit`` table is read by its own lookups only (each rank looks up its rows; no
    other op could take rows of chosen counts): a parameter tied to another module's is refused."""
    names = [name for name, p in model.named_parameters(remove_duplicate=False) if p is param]
    if len(names) < 2:
        return
    modules = dict(model.named_modules(remove_duplicate=False))
    others = ", ".join(
        f"{name!r} of {describe_module(name.rpartition('.')[0], modules[name.rpartition('.')[0]])}"
        for name in names
        if name != own
    )
    even = tuple(item.axis if isinstance(item, ManualSplit) else item for item in strategy)
    raise AnnotationError(
        f"{where}: ManualSplit splits parameter {own!r} in rows of its own, but the parameter is tied: "
        f"it is also {others}, which reads the same tensor; a ManualSplit table is held by one module "
        f"only (its rows are read by that module's lookups), so split it by the axis name instead "
        f"(parameter_plan {even!r}: even pieces, which every reader can take), or untie the weights"
    )


def _parts_alone(strategy: Strategy, layout: Layout, where: str) -> tuple[int, Parts]:
    """The dim and :class:`Parts` of unequal sizes of a parameter's ``strategy``, which must split
    nothing else (its ``layout`` otherwise whole)."""
    d, item = unequal_parts(strategy)
    if any(not isinstance(p, Replicate) for p in layout):
        raise AnnotationError(
            f"{where}: {item!r} on dim {d} lays out each part's slice, so the strategy splits no other "
            f"dim; got {strategy!r}"
        )
    return d, item


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
                    f"pipeline_stage: {describe_module(inner, modules[inner])} is in stage {j} but sits "
                    f"inside {describe_module(outer, modules[outer])} in stage {k}"
                )
