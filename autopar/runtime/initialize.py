"""Initial values for a model built on ``meta``: what the model's own code would have made.

A tensor on ``meta`` has a shape but no value, and the code that gave it its value (a
module's ``__init__``) has already run. What autopar can run again is the model's
*initializers*, in the order building on the CPU runs them:

1. a ``transformers`` model (duck-typed: ``config``, ``_init_weights`` and
   ``initialize_weights`` or ``init_weights``) initialises its whole subtree with the
   library's own code, as its ``post_init`` does on the CPU (norm weights set to one,
   rotary ``inv_freq`` recomputed from the config, BERT's ``position_ids``, GPT-2's
   scaled projections). Ties (``lm_head`` = embeddings) are kept: every tensor with
   several names stays one tensor.
2. every other module's ``reset_parameters()`` (torch's layers: weights, biases and
   BatchNorm's running statistics) and torch's private ``_reset_parameters()``
   (``MultiheadAttention``, ``Transformer``), children before parents as their
   ``__init__`` calls them; inside a transformers model only where step 1 left one of
   the module's own tensors unset.
3. ``init(module)`` for every module, children first, when the caller gives one.

All of it runs on the CPU after ``torch.manual_seed(seed)`` (the caller's RNG is left as
it was), so every rank computes the same values without communicating. Tensors that are
not on ``meta`` (a module built on the CPU, a checkpoint loaded with
``load_state_dict(..., assign=True)``) keep their values. A tensor that none of the
steps sets is found (floating and integer tensors start as NaN or their type's minimum,
other dtypes are judged by their version counter) and raises
:class:`~autopar.ir.errors.InitializationError` naming it: autopar never hands back
uninitialised memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar.ir.errors import InitializationError

_NAN_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}
_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
_HF_FLAG = "_is_hf_initialized"  # transformers' "already initialised/loaded" mark: a copy must not inherit it


@dataclass
class _Entry:
    """One tensor of the copy (several names when tied) and where it is held."""

    names: list[str]
    slots: list[tuple[nn.Module, str, str]]  # (module, "_parameters" or "_buffers", attribute)
    fresh: torch.Tensor | None = None  # the CPU tensor allocated for it, filled with the sentinel
    version: int = 0  # fresh's version counter once filled
    real: torch.Tensor | None = None  # the caller's tensor when it was not on meta: kept as it is
    owners: list[str] = field(default_factory=list)  # the class of each slot's module
    known_set: bool = False  # found set once: not scanned again


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def initialize(model: nn.Module, seed: int, init: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """A copy of ``model`` on the CPU whose ``meta`` tensors hold their initial values (see module docstring).

    ``model`` itself is not changed. Raises :class:`InitializationError` naming every
    tensor that no initializer set, or the module whose initializer failed.
    """
    replica, real = _copy_with_placeholders(model)
    entries = _allocate(replica, real)
    for module in replica.modules():
        module.__dict__.pop(_HF_FLAG, None)
    by_fresh = {id(e.fresh): e for e in entries}
    with torch.random.fork_rng(), torch.no_grad(), torch.device("cpu"):
        torch.manual_seed(seed)
        _run_initializers(replica, by_fresh, init)
    unset = [e for e in entries if e.real is None and _unset(e)]
    if unset:
        raise _unset_error(unset, _library_models(replica) != [])
    memo: dict[int, object] = {}
    for e in entries:
        if e.real is not None:
            kept = copy.deepcopy(e.real, memo)  # a copy, as the rest: the caller's model stays its own
            for module, store, attr in e.slots:
                getattr(module, store)[attr] = kept
    return replica


def _copy_with_placeholders(model: nn.Module) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    """A deep copy of ``model`` with every tensor on meta (real ones replaced by meta placeholders).

    Returns the copy and, by placeholder id, the caller's real tensor it stands for: the
    initializers scribble on a scratch tensor, and the real one is copied in afterwards.
    """
    memo: dict[int, object] = {}
    real: dict[int, torch.Tensor] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_meta or id(t) in memo:
            continue
        placeholder = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            placeholder = nn.Parameter(placeholder, requires_grad=t.requires_grad)
        memo[id(t)] = placeholder
        real[id(placeholder)] = t
    return copy.deepcopy(model, memo), real


def _allocate(replica: nn.Module, real: dict[int, torch.Tensor]) -> list[_Entry]:
    """Give every tensor of ``replica`` CPU memory filled with the sentinel; ties stay ties."""
    entries: dict[int, _Entry] = {}
    seen: set[tuple[int, str, str]] = set()
    for path, module in replica.named_modules(remove_duplicate=False):
        for store in ("_parameters", "_buffers"):
            for attr, t in getattr(module, store).items():
                if t is None or (id(module), store, attr) in seen:
                    continue
                seen.add((id(module), store, attr))
                entry = entries.setdefault(id(t), _Entry([], [], real=real.get(id(t))))
                entry.names.append(f"{path}.{attr}" if path else attr)
                entry.slots.append((module, store, attr))
                entry.owners.append(type(module).__name__)
                if entry.fresh is None:
                    entry.fresh = _fresh(t)
                    entry.version = entry.fresh._version
                getattr(module, store)[attr] = entry.fresh
    return list(entries.values())


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """CPU memory for meta tensor ``t`` (its dtype, shape and strides), holding the sentinel."""
    data = torch.empty_like(t, device="cpu")
    with torch.no_grad():
        if t.dtype in _NAN_DTYPES:
            data.fill_(float("nan"))
        elif t.dtype in _INT_DTYPES:
            data.fill_(torch.iinfo(t.dtype).min)
    if not isinstance(t, nn.Parameter):
        return data
    fresh = nn.Parameter(data, requires_grad=t.requires_grad)
    fresh.__dict__.update({k: v for k, v in t.__dict__.items() if k != _HF_FLAG})
    return fresh


def _unset(entry: _Entry) -> bool:
    """Whether some name of ``entry`` still holds no value: meta, or the sentinel (partly) left.

    A tensor an initializer replaced by a new one counts as set unless the new one is on meta.
    """
    if entry.known_set:
        return False
    for module, store, attr in entry.slots:
        t = getattr(module, store).get(attr)
        if t is None:
            continue
        if t is not entry.fresh:
            if t.is_meta:
                return True
            continue
        if t.dtype in _NAN_DTYPES:
            if _has_nan(t):
                return True
        elif t._version == entry.version and (
            t.dtype not in _INT_DTYPES or (t == torch.iinfo(t.dtype).min).any()
        ):
            return True
    entry.known_set = True
    return False


def _has_nan(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a NaN (its maximum propagates one: one pass, no mask allocated)."""
    if t.numel() == 0:
        return False
    return bool(torch.view_as_real(t).amax().isnan() if t.is_complex() else t.amax().isnan())


def _is_library_model(module: nn.Module) -> bool:
    """Whether ``module`` looks like a ``transformers.PreTrainedModel`` (not imported: optional)."""
    return (
        hasattr(module, "config")
        and callable(getattr(module, "_init_weights", None))
        and (
            callable(getattr(module, "initialize_weights", None))
            or callable(getattr(module, "init_weights", None))
        )
    )


def _library_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models in ``model`` (itself, or ones it wraps), with their paths."""
    if _is_library_model(model):
        return [("", model)]
    return [
        (f"{name}.{path}" if path else name, found)
        for name, child in model.named_children()
        for path, found in _library_models(child)
    ]


def _post_order(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module once, children before their parent, as ``__init__`` builds them."""
    seen: set[int] = set()

    def visit(path: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        if id(module) in seen:
            return
        seen.add(id(module))
        for name, child in module.named_children():
            yield from visit(f"{path}.{name}" if path else name, child)
        yield path, module

    yield from visit("", model)


def _own_initializer(module: nn.Module) -> Callable[[], None] | None:
    """``module.reset_parameters``, or torch's private ``_reset_parameters`` for torch's own layers."""
    fn = getattr(module, "reset_parameters", None)
    if callable(fn):
        return fn
    fn = getattr(module, "_reset_parameters", None)
    if callable(fn) and type(module).__module__.startswith("torch.nn."):
        return fn
    return None


def _run_initializers(
    replica: nn.Module, by_fresh: dict[int, _Entry], init: Callable[[nn.Module], None] | None
) -> None:
    """Steps 1 to 3 of the module docstring, on ``replica`` in place."""
    in_library: set[int] = set()
    for path, lib_model in _library_models(replica):
        run = getattr(lib_model, "initialize_weights", None)
        run = run if callable(run) else lib_model.init_weights
        _call(run, path, lib_model, "its transformers initialisation")
        in_library.update(id(m) for m in lib_model.modules())
    for path, module in _post_order(replica):
        fn = _own_initializer(module)
        if fn is None:
            continue
        if id(module) in in_library and not _owns_unset(module, by_fresh):
            continue
        _call(fn, path, module, f"{fn.__name__}()")
    if init is not None:
        for path, module in _post_order(replica):
            _call(lambda m=module: init(m), path, module, "init(module)")


def _owns_unset(module: nn.Module, by_fresh: dict[int, _Entry]) -> bool:
    """Whether one of ``module``'s own meta tensors is still unset."""
    for t in (*module._parameters.values(), *module._buffers.values()):
        entry = by_fresh.get(id(t)) if t is not None else None
        if entry is not None and entry.real is None and _unset(entry):
            return True
    return False


def _call(fn: Callable[[], None], path: str, module: nn.Module, what: str) -> None:
    """Run one initializer; a failure names the module and the initializer."""
    try:
        fn()
    except Exception as e:
        where = path or "the model"
        raise InitializationError(
            f"initialising the model built on meta: {what} of {where} ({type(module).__name__}) "
            f"failed: {type(e).__name__}: {e}"
        ) from e


def _unset_error(unset: list[_Entry], library: bool) -> InitializationError:
    """The error naming every tensor no initializer set, and what the user can do."""
    lines = []
    for e in unset[:20]:
        kind = "parameter" if e.slots[0][1] == "_parameters" else "buffer"
        aka = f" (also {', '.join(e.names[1:])})" if len(e.names) > 1 else ""
        fresh = e.fresh if e.fresh is not None else torch.empty(0)
        lines.append(
            f"  {e.names[0]}{aka}: {kind} of {e.owners[0]}, shape {tuple(fresh.shape)}, {fresh.dtype}"
        )
    if len(unset) > 20:
        lines.append(f"  ... and {len(unset) - 20} more")
    hf = (
        "; in a transformers model, its _init_weights(module) can set them (override it in a subclass)"
        if library
        else ""
    )
    return InitializationError(
        f"{len(unset)} tensor(s) of the model built on meta have no known initial value: no "
        "reset_parameters(), torch layer or transformers _init_weights sets them, and autopar "
        "will not hand back uninitialised memory:\n" + "\n".join(lines) + "\nTo fix it, either:\n"
        "  - give the module a reset_parameters() that sets all its own tensors (autopar calls it "
        f"on every rank, children before parents, after torch.manual_seed(seed)){hf};\n"
        "  - create these tensors off meta, e.g. torch.ones(4, device='cpu') inside the module's "
        "__init__, or build the module on the CPU: tensors not on meta keep their values;\n"
        "  - load their values before compiling, model.load_state_dict(state, strict=False, assign=True) "
        "(parameters and persistent buffers only);\n"
        "  - or call autopar.runtime.materialize.materialize(model, seed, init=fn) yourself, with "
        "fn(module) setting them, and compile what it returns."
    )
