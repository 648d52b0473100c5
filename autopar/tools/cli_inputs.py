"""What the ``autopar`` command line reads: meshes, byte counts, counts, and the model a ``MODEL`` spec names.

Every mistake is a :class:`UsageError` with one line saying what was given and what is
expected; :func:`autopar.tools.cli.main` prints it and exits with status 2. The flags are
checked as they are parsed, before any long work starts (building, capture, planning).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

USAGE_ERROR = 2


class UsageError(argparse.ArgumentTypeError):
    """Bad command-line input: printed as one line, exit status 2 (an ``ArgumentTypeError``, so the
    parsers below serve as argparse ``type`` s and a flag is checked as it is read)."""


# --- parsing ---------------------------------------------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=4"`` -> ``{"dp": 2, "tp": 4}``."""
    mesh: dict[str, int] = {}
    for item in text.split(","):
        name, eq, size = item.strip().partition("=")
        if not eq or not name.isidentifier() or not size.isdigit() or int(size) < 1 or name in mesh:
            raise UsageError(
                f"mesh {text!r}: expected axis=size items separated by commas, each axis once, e.g. dp=2,tp=4"
            )
        mesh[name] = int(size)
    return mesh


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_bytes(text: str) -> float:
    """``"80GB"``, ``"40e9"``, ``"512MiB"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(f"budget {text!r}: expected bytes such as 80GB, 40e9 or 512MiB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UsageError(f"budget {text!r} must be positive")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: a count of at least 1 (``--batch``, ``--seq``)."""
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{text!r} is not a count: expected a whole number >= 1")
    return int(text)


def parse_counts(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``: device counts, each at least 1."""
    words = text.split(",")
    if not all(w.strip().isdigit() and int(w) >= 1 for w in words):
        raise UsageError(f"devices {text!r}: expected counts >= 1 separated by commas, e.g. 1,2,4,8")
    return [int(w) for w in words]


def parse_slowdowns(text: str) -> list[float]:
    """``"1,1,1,3"`` -> ``[1.0, 1.0, 1.0, 3.0]``: how many times slower each replica runs, each >= 1."""
    try:
        found = [float(w) for w in text.split(",")]
    except ValueError:
        found = []
    if not found or min(found) < 1 or not all(math.isfinite(f) for f in found):
        raise UsageError(f"stragglers {text!r}: expected slowdowns >= 1 separated by commas, e.g. 1,1,1,3")
    return found


def cluster_name(name: str) -> str:
    """``name`` if it is a cluster preset or a readable cluster file (``.json``) of this machine."""
    from autopar.ir.errors import OptionError
    from autopar.planning.cost import get_cluster

    try:
        get_cluster(name)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    return name


def writable(path: str) -> str:
    """``path`` if a file can be written there: its folder exists (checked before planning)."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise UsageError(f"cannot write {path}: there is no folder {folder}")
    return path


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _overrides(words: Sequence[str]) -> dict[str, Any]:
    out = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not key.isidentifier():
            raise UsageError(f"model option {word!r}: expected key=value, e.g. n_layer=2")
        out[key] = _value(value)
    return out


# --- models ------------------------------------------------------------------------------


def load_model(
    spec: str, options: Sequence[str], batch: int, seq: int
) -> tuple[torch.nn.Module, tuple, dict]:
    """The model and example inputs ``(model, args, kwargs)`` a ``MODEL`` spec names."""
    overrides = _overrides(options)
    if spec.startswith("hf:"):
        return _transformers_model(spec[3:], overrides, batch, seq)
    path, colon, factory = spec.rpartition(":")
    if not colon or not path.endswith(".py") or not factory.isidentifier():
        raise UsageError(f"model {spec!r}: expected path/to/file.py:factory or hf:ARCH (e.g. hf:gpt2)")
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"model {spec!r}: no file {file}")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up while it runs
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: any failure is reported in one line
        raise UsageError(f"model {spec!r}: running {file} failed: {_one_line(exc)}") from None
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise UsageError(f"model {spec!r}: {file} has no function {factory!r}")
    try:
        built = fn(**overrides)
    except Exception as exc:  # noqa: BLE001 - the user's factory, as above
        call = f"{factory}({', '.join(overrides)})"
        raise UsageError(f"model {spec!r}: {call} failed: {_one_line(exc)}") from None
    if not (isinstance(built, tuple) and len(built) in (2, 3) and isinstance(built[0], torch.nn.Module)):
        raise UsageError(f"model {spec!r}: {factory} must return (model, args) or (model, args, kwargs)")
    model, args = built[0], built[1] if isinstance(built[1], tuple) else (built[1],)
    return model, args, dict(built[2]) if len(built) == 3 else {}


def _transformers_model(
    arch: str, overrides: dict, batch: int, seq: int
) -> tuple[torch.nn.Module, tuple, dict]:
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        # training captures no key/value cache (its objects are no tensors export can return)
        config = transformers.AutoConfig.for_model(arch, use_cache=False)
    except ValueError:
        raise UsageError(
            f"model hf:{arch}: not a transformers model type (e.g. hf:gpt2, hf:llama, hf:bert)"
        ) from None
    fields = set(config.to_dict()) | set(config.attribute_map)
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise UsageError(f"model hf:{arch}: its config has no field {key!r}{hint}")
    config = transformers.AutoConfig.for_model(arch, **{"use_cache": False, **overrides})
    with torch.device("meta"):
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM):
            try:
                model = auto.from_config(config)
                break
            except ValueError:
                continue
        else:
            raise UsageError(f"model hf:{arch}: neither a causal nor a masked language model")
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (), {"input_ids": ids, "labels": ids}


def _one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: message`` on one line (a syntax error's message names its line)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
