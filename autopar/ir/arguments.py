"""Checks of the values users pass as options: an int is an int, a number a number, a flag a bool.

Nothing is coerced: ``2.5`` or ``True`` where a count is expected, or ``"40GB"`` where bytes
are, is an :class:`~autopar.ir.errors.OptionError` naming the option and what it takes.
The inputs a compiled module is called with are checked alike (:func:`input_structure`,
:func:`check_input_tensor`): a missing input or another dtype is a
:class:`~autopar.ir.errors.ShapeError` naming the input.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from autopar.ir.errors import OptionError, ShapeError

_LISTED = 12  # an unknown key's error lists the known ones when there are no more


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool`` (``True`` as a count is surely a mistake)."""
    return isinstance(value, int) and not isinstance(value, bool)


def plain_number(value: object) -> object:
    """``value`` as a Python ``int`` or ``float`` where it is another scalar type standing for the same
    value exactly (``numpy.int64(5)``, ``numpy.float32(0.5)``: any ``numbers.Integral`` or
    ``numbers.Real`` but a bool); anything else (a bool, a tensor, a string) as it is, for the checks
    to refuse. So a count taken from numpy is a count, and nothing non-numeric becomes one.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_int(value: object, what: str, *, minimum: int = 0) -> int:
    """``value`` if it is an int of at least ``minimum``."""
    if not is_int(value) or value < minimum:
        raise OptionError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def check_number(
    value: object,
    what: str,
    *,
    unit: str = "",
    minimum: float = 0.0,
    inclusive: bool = False,
    below: float | None = None,
) -> float:
    """``value`` if it is a finite number (an int or a float, not a bool or a string) above ``minimum``
    (or equal to it, where ``inclusive``) and, where ``below`` is given, below ``below``."""
    number = (is_int(value) or isinstance(value, float)) and math.isfinite(value)
    above = number and (value > minimum or inclusive and value == minimum)
    if not above or below is not None and value >= below:
        hint = f" ({unit})" if unit else ""
        bound = f">= {minimum:g}" if inclusive else f"above {minimum:g}"
        bound += f" and below {below:g}" if below is not None else ""
        raise OptionError(f"{what} must be a number {bound}{hint}, got {value!r}")
    return value


def check_bool(value: object, what: str) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise OptionError(f"{what} must be True or False, got {value!r}")
    return value


def check_instance(value: object, kind: type | tuple[type, ...], what: str, expected: str) -> Any:
    """``value`` if it is an instance of ``kind`` (``expected`` says so in words)."""
    if not isinstance(value, kind):
        raise OptionError(f"{what} must be {expected}, got {type(value).__name__} {value!r}")
    return value


def check_keys(
    data: object,
    what: str,
    known: Iterable[str],
    *,
    required: Iterable[str] = (),
    aliases: Mapping[str, str] | None = None,
) -> Mapping[str, Any]:
    """``data`` if it is a mapping whose keys are all ``known`` and include every ``required`` one.

    An unknown key's error names the nearest known one: ``aliases`` maps other names in common
    use to known ones (``"bf16"`` -> ``"bfloat16"``), then the closest spelling is suggested.
    """
    if not isinstance(data, Mapping):
        raise OptionError(
            f"{what} must be a mapping (a dict; in a file, a JSON object), got {type(data).__name__} {data!r}"
        )
    names = sorted(known)
    for key in data:
        if key in names:
            continue
        near = (aliases or {}).get(str(key).lower()) if isinstance(key, str) else None
        close = [near] if near else difflib.get_close_matches(str(key), names, n=1)
        listed = f"; known keys: {', '.join(names)}" if len(names) <= _LISTED else ""
        hint = f"; did you mean {close[0]!r}?" if close else listed
        raise OptionError(f"{what}: unknown key {key!r}{hint}")
    missing = [repr(key) for key in required if key not in data]
    if missing:
        raise OptionError(f"{what} lacks {', '.join(missing)}")
    return data


# --- the inputs a compiled module is called with --------------------------------------------


def _form(spec: Any) -> str:
    """A pytree structure in words: ``a single value``, ``a list of 3``, ``a dict with keys ['a']``."""
    if spec.is_leaf():
        return "a single value"
    if spec.type is dict:
        return f"a dict with keys {list(spec.context)}"
    return f"a {spec.type.__name__} of {spec.num_children}"


def _first_leaves(spec: Any, names: Sequence[str]) -> list[str]:
    """For each child of ``spec``, how messages name it: its leaf's name where it is one value, else
    the names of its leaves (``names``: every leaf's, in order)."""
    out, start = [], 0
    for i in range(spec.num_children):
        child = spec.child(i)
        own = names[start : start + child.num_leaves]
        out.append(repr(own[0]) if child.is_leaf() and own else f"[{', '.join(own)}]")
        start += child.num_leaves
    return out


def input_structure(expected: Any, given: Any, names: Sequence[str]) -> str:
    """How the pytree structure ``given`` of a call's ``(args, kwargs)`` differs from ``expected``, the
    structure a module was compiled with, naming the inputs.

    Args:
        expected: the compiled ``(args, kwargs)`` structure (a pytree ``TreeSpec``).
        given: the structure of the call's ``(args, kwargs)``.
        names: the names of ``expected``'s leaves, in order.
    """
    args, kwargs = expected.child(0), expected.child(1)
    labels = _first_leaves(args, names)
    compiled = f"the module was compiled with {args.num_children} positional inputs ({', '.join(labels)})"
    if given.num_children != 2 or given.child(0).num_children < args.num_children:
        n = given.child(0).num_children if given.num_children == 2 else 0
        missing = " and ".join(f"{label} (position {i})" for i, label in enumerate(labels) if i >= n)
        return f"input {missing} is missing: {compiled}, got {n}"
    if given.child(0).num_children > args.num_children:
        return f"got {given.child(0).num_children} positional inputs, but {compiled}"
    for i, label in enumerate(labels):
        if given.child(0).child(i) != args.child(i):
            return (
                f"input {label} (position {i}) is {_form(given.child(0).child(i))}, but the module was "
                f"compiled with {_form(args.child(i))} there"
            )
    have = {k: given.child(1).child(i) for i, k in enumerate(given.child(1).context)}
    for i, key in enumerate(kwargs.context):
        if key not in have:
            return f"keyword input {key!r} is missing: the module was compiled with {list(kwargs.context)}"
        if have[key] != kwargs.child(i):
            return (
                f"keyword input {key!r} is {_form(have[key])}, but the module was compiled with "
                f"{_form(kwargs.child(i))} there"
            )
    return f"expected {expected}, got {given}"


def check_input_tensor(name: str, value: object, compiled: torch.Tensor) -> torch.Tensor:
    """``value`` if it is a tensor of the dtype a module's input ``name`` was compiled for (its
    example ``compiled``'s): the program's ops were planned and checked for that dtype.

    Args:
        name: the input, as the compiled program names it.
        value: what the call gives for it.
        compiled: the example the module was compiled with (or its fake value).
    """
    if not isinstance(value, torch.Tensor):
        plain = value is None or isinstance(value, (bool, int, float, str))
        shown = repr(value) if plain else f"a {type(value).__name__}"
        raise ShapeError(
            f"input {name!r} is {shown}, but the module was compiled with a tensor there ({compiled.dtype}, "
            f"global shape {tuple(compiled.shape)}): pass a tensor"
        )
    if value.dtype != compiled.dtype:
        raise ShapeError(
            f"input {name!r} has dtype {value.dtype}, but the module was compiled for {compiled.dtype} (its "
            f"example's): pass {compiled.dtype} ({name}.to({compiled.dtype})), or compile again with a "
            f"{value.dtype} example"
        )
    return value
