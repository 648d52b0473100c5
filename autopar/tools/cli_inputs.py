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
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

USAGE_ERROR = 2


class UsageError(argparse.ArgumentTypeError):
    """Bad command-line input: printed as one line, exit status 2 (an ``ArgumentTypeError``, so the
    parsers below serve as argparse ``type`` s and a flag is checked as it is read)."""


# --- parsing ---------------------------------------------------------------------------


def _is_count(word: str) -> bool:
    """True for a whole number >= 1 in ASCII digits (``"²"`` and ``"٤"`` are digits to ``str.isdigit``)."""
    return word.isascii() and word.isdigit() and int(word) >= 1


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,tp=4"`` -> ``{"dp": 2, "tp": 4}``."""
    mesh: dict[str, int] = {}
    for item in text.split(","):
        name, eq, size = item.strip().partition("=")
        if not eq or not name.isidentifier() or not _is_count(size) or name in mesh:
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
    if not _is_count(text):
        raise UsageError(f"{text!r} is not a count: expected a whole number >= 1")
    return int(text)


def parse_counts(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``: device counts, each at least 1 and given once."""
    words = [w.strip() for w in text.split(",")]
    if not all(_is_count(w) for w in words):
        raise UsageError(f"devices {text!r}: expected counts >= 1 separated by commas, e.g. 1,2,4,8")
    counts = [int(w) for w in words]
    twice = sorted({n for n in counts if counts.count(n) > 1})
    if twice:
        raise UsageError(f"devices {text!r}: {twice[0]} is given twice; give each device count once")
    return counts


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
    from autopar.planning.cost.model import get_cluster

    try:
        get_cluster(name)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    return name


def writable(path: str) -> str:
    """``path`` if a file can be written there: its folder exists and it is no folder itself (checked
    before planning; a write that fails later, such as into ``/proc``, is one line too)."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise UsageError(f"cannot write {path}: there is no folder {folder}")
    if Path(path).is_dir():
        raise UsageError(f"cannot write {path}: it is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write {path}: the folder {folder} is not writable")
    return path


def plot_file(path: str) -> str:
    """``path`` if it names an image the plot can be written as (``.png`` or ``.svg``) where a file can
    be written (``--plot``)."""
    if Path(path).suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"plot {path}: expected a .png or .svg file name")
    return writable(path)


def width(text: str) -> int:
    """An argparse ``type``: a table width of at least :data:`MIN_WIDTH` characters (``--width``)."""
    if not _is_count(text) or int(text) < MIN_WIDTH:
        raise UsageError(f"width {text!r}: expected a whole number of characters >= {MIN_WIDTH}")
    return int(text)


MIN_WIDTH = 40  # narrower tables wrap every cell over several lines


def _value(text: str) -> Any:
    """A ``key=value`` word's value: a Python literal (``2``, ``0.1``, ``True``, ``'gelu'``), ``nan`` or
    ``inf`` as the float they name (refused where a number is expected), else the text itself."""
    if text.strip().lstrip("+-").lower() in ("nan", "inf", "infinity"):
        return float(text)
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
        if key in out:
            raise UsageError(
                f"model option {key!r} is given twice ({key}={out[key]!r}, then {word}): give it once"
            )
        out[key] = _value(value)
    return out


# --- models ------------------------------------------------------------------------------


HF_BATCH, HF_SEQ = 8, 128  # an hf: model's example batch where --batch or --seq is not given


def load_model(
    spec: str, options: Sequence[str], batch: int | None, seq: int | None
) -> tuple[torch.nn.Module, tuple, dict]:
    """The model and example inputs ``(model, args, kwargs)`` a ``MODEL`` spec names.

    Args:
        spec: ``hf:ARCH`` or ``path/to/file.py:factory``.
        options: ``key=value`` words: config fields of ``hf:`` models, else the factory's arguments.
        batch: sequences of an ``hf:`` model's example batch (None: :data:`HF_BATCH`); a factory's
            model makes its own inputs, so giving it is a :class:`UsageError`.
        seq: tokens per sequence of an ``hf:`` model's example batch (no longer than its positions;
            None: :data:`HF_SEQ`); a factory's model takes none either.
    """
    overrides = _overrides(options)
    if spec.startswith("hf:"):
        batch, seq = HF_BATCH if batch is None else batch, HF_SEQ if seq is None else seq
        return _transformers_model(spec[3:], overrides, batch, seq)
    given = [f"--{flag} {value}" for flag, value in (("batch", batch), ("seq", seq)) if value is not None]
    if given:
        raise UsageError(
            f"model {spec!r}: {' and '.join(given)} size the example batch of hf: models only; a factory "
            "makes its own example inputs (give its arguments as key=value words, e.g. batch_size=16)"
        )
    return _factory_model(spec, overrides)


def samples_per_step(spec: str, batch: int | None, args: tuple, kwargs: Mapping[str, Any]) -> int:
    """The samples of one step's example batch: ``--batch`` (or :data:`HF_BATCH`) for an ``hf:`` model,
    else the size of dim 0 of the factory's first tensor input (``--stragglers`` prices updates per sample).

    Args:
        spec: the ``MODEL`` spec.
        batch: ``--batch`` (None where not given).
        args: the example's positional inputs.
        kwargs: the example's keyword inputs.
    """
    if spec.startswith("hf:"):
        return HF_BATCH if batch is None else batch
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not tensors:
        raise UsageError(
            f"model {spec!r}: --stragglers counts samples along dim 0 of a tensor input; it has none"
        )
    return tensors[0].shape[0]


def _factory_model(spec: str, overrides: dict[str, Any]) -> tuple[torch.nn.Module, tuple, dict]:
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
    args = (built[1],) if isinstance(built[1], torch.Tensor) else built[1]
    kwargs = built[2] if len(built) == 3 else {}
    if not isinstance(args, tuple) or not isinstance(kwargs, Mapping):
        wrong, value = ("args", args) if not isinstance(args, tuple) else ("kwargs", kwargs)
        raise UsageError(
            f"model {spec!r}: {factory} returned its example {wrong} as {type(value).__name__}; "
            "it must return (model, args) or (model, args, kwargs): args a tuple of positional inputs (or "
            "one tensor), kwargs a dict of keyword inputs"
        )
    return built[0], args, dict(kwargs)


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
    for key, value in overrides.items():
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise UsageError(f"model hf:{arch}: its config has no field {key!r}{hint}")
        _check_field(arch, config, key, value)
    given = " ".join(f"{k}={v!r}" for k, v in overrides.items())
    try:
        config = transformers.AutoConfig.for_model(arch, **{"use_cache": False, **overrides})
    except Exception as exc:  # noqa: BLE001 - transformers' own check of a field, in one line
        raise UsageError(f"model hf:{arch} {given}: its config refuses it: {_one_line(exc)}") from None
    _check_positions(arch, config, seq)
    autos = [
        auto
        for auto, kinds in (
            (transformers.AutoModelForCausalLM, transformers.MODEL_FOR_CAUSAL_LM_MAPPING),
            (transformers.AutoModelForMaskedLM, transformers.MODEL_FOR_MASKED_LM_MAPPING),
        )
        if type(config) in kinds
    ]
    if not autos:
        raise UsageError(f"model hf:{arch}: neither a causal nor a masked language model")
    try:
        with torch.device("meta"):
            model = autos[0].from_config(config)
    except Exception as exc:  # noqa: BLE001 - the config's fields do not fit together, in one line
        raise UsageError(f"model hf:{arch} {given}: transformers cannot build it: {_one_line(exc)}") from None
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")  # id 0: in every vocabulary (>= 1)
    return model, (), {"input_ids": ids, "labels": ids}


# config fields that count something (by their canonical names): each at least 1
_COUNTS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "head_dim",
        "n_inner",
    }
)


def _check_field(arch: str, config: Any, key: str, value: Any) -> None:
    """A config override of the type its field holds (an int is an int, a flag a bool), finite, and
    an int >= 1 where the field counts something; a field that holds None by default takes any value."""
    from autopar.ir.arguments import is_int

    default = getattr(config, key)
    canonical = next((k for k, v in config.attribute_map.items() if v == key), key)
    number = (is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if canonical in _COUNTS and value is not None:
        ok, expected = is_int(value) and value >= 1, "an int >= 1"
    elif isinstance(default, bool):
        ok, expected = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
        ok, expected = is_int(value), "an int"
    elif isinstance(default, float):
        ok, expected = number, "a finite number"
    elif isinstance(default, str):
        ok, expected = isinstance(value, str), "a string"
    else:
        ok, expected = not isinstance(value, float) or number, "a finite number"
    if not ok:
        raise UsageError(f"model hf:{arch}: config field {key}={value!r}: expected {expected}")


def _check_positions(arch: str, config: Any, seq: int) -> None:
    """``--seq`` no longer than the positions the model has (GPT-2's ``n_positions``)."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq > limit:
        names = [v for k, v in config.attribute_map.items() if k == "max_position_embeddings"]
        field = " = ".join([*names, "max_position_embeddings"])
        raise UsageError(
            f"model hf:{arch}: --seq {seq} is longer than its {field} ({limit} positions): give --seq "
            f"{limit} or less, or {(names or ['max_position_embeddings'])[0]}={seq}"
        )


def _one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: message`` on one line (a syntax error's message names its line)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
