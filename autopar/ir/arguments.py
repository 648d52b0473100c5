"""Checks of the values users pass as options: an int is an int, a number a number, a flag a bool.

Nothing is coerced: ``2.5`` or ``True`` where a count is expected, or ``"40GB"`` where bytes
are, is an :class:`~autopar.ir.errors.OptionError` naming the option and what it takes.
"""

from __future__ import annotations

import math
from typing import Any

from autopar.ir.errors import OptionError


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool`` (``True`` as a count is surely a mistake)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: object, what: str, *, minimum: int = 0) -> int:
    """``value`` if it is an int of at least ``minimum``."""
    if not is_int(value) or value < minimum:
        raise OptionError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def check_number(value: object, what: str, *, unit: str = "") -> float:
    """``value`` if it is a finite number above 0 (an int or a float, not a bool or a string)."""
    if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        hint = f" ({unit})" if unit else ""
        raise OptionError(f"{what} must be a number above 0{hint}, got {value!r}")
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
