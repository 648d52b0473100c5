"""How a checkpoint lies on disk: a folder switched in whole, with a manifest of checksums last.

A checkpoint at ``path`` is a ``torch.distributed.checkpoint`` folder (each rank's
``__<rank>_<i>.distcp`` files, the coordinator's ``.metadata``) plus ``manifest.json``: the
format, the step, the optimizer's class and each file's size and sha256. The manifest is
written last, so a folder without one is unfinished and never loaded.

A save writes into a new hidden sibling, ``.<name>.autopar-new-<nonce>``, on the same
filesystem, and only once it holds its manifest switches it in by renames: an existing
``path`` is renamed aside to ``.<name>.autopar-old-<nonce>``, the new folder to ``path``,
and then the siblings are removed. Every state in between holds a complete checkpoint:
before the first rename ``path`` is the previous one; between the two renames ``path`` is
missing and :func:`resolve` takes the newest complete sibling (the new one); after, ``path``
is the new one. A save cut short leaves at most an unfinished sibling, which the next
successful save of ``path`` removes.

A load first reads the manifest, checks every file against it (:func:`read_manifest`,
:func:`verify`) and the checkpoint's keys, shapes and dtypes against what the module and
optimizer hold (:func:`check_entries`). Where a process group exists, every rank takes part
(:func:`agree`, and :mod:`autopar.runtime.ranks`: one rank's failure is raised on all), and
the first rank creates and switches the folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from autopar.ir.arguments import is_int
from autopar.ir.errors import CheckpointError
from autopar.runtime.ranks import any_rank, gathered, ranks, shared

MANIFEST = "manifest.json"
FORMAT = 1  # of the folder: DCP's table (runtime/training_state.py) and the manifest
_KEYS = {"format", "step", "optimizer", "created_ns", "files"}
_TAG = ".autopar-"  # hidden siblings: f".{name}{_TAG}new-{nonce}", f".{name}{_TAG}old-{nonce}"
_CHUNK = 1 << 22
OPTIMIZER_STATE = "optimizer.state."  # DCP's flat keys of optimizer state: this + "<fqn>.<name>"


# --- the ranks agreeing -------------------------------------------------------------------------
def agree(error: CheckpointError | None, value: Any = None) -> list[Any]:
    """Every rank's ``value``, unless a rank failed: then the first failing rank's ``error`` is raised on
    every rank (one rank's failure must not leave the others waiting in a later collective); the
    rank that failed raises its own, with its cause."""
    reports = gathered((None if error is None else str(error), value))
    if error is not None:
        raise error
    messages = [message for message, _ in reports if message is not None]
    if messages:
        raise CheckpointError(messages[0])
    return [v for _, v in reports]


def on_first_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run by the first rank: its result, or its :class:`CheckpointError`, on every rank."""
    result, error = None, None
    if ranks()[0] == 0:
        try:
            result = fn(*args)
        except CheckpointError as exc:
            error = exc
    message, result = shared((None if error is None else str(error), result))
    if error is not None:
        raise error
    if message is not None:
        raise CheckpointError(message)
    return result


# --- paths --------------------------------------------------------------------------------------
def checkpoint_path(path: object, caller: str) -> Path:
    """``path`` as an absolute path, if it is a non-empty ``str`` or ``os.PathLike`` naming a folder."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        raise CheckpointError(
            f"{caller}'s path must be a non-empty str or os.PathLike naming the checkpoint's folder, "
            f"got {type(path).__name__} {path!r}"
        )
    problem = path_problem(text)
    if problem:
        raise CheckpointError(f"{caller}'s path {text!r} {problem}")
    absolute = Path(os.path.abspath(text))
    if not absolute.name:
        raise CheckpointError(f"{caller}'s path {text!r} names no folder (the filesystem's root)")
    return absolute


def path_problem(text: str) -> str | None:
    """Why the path ``text`` is surely not the one meant (None if nothing is): a NUL byte, a ``~``
    that no shell expanded (Python does not: it would name a folder ``~`` here), or a last name that
    is blank or begins or ends with spaces.

    Args:
        text: a path as the user gave it.
    """
    if "\0" in text:
        return "holds a NUL byte, which no path can"
    if text.startswith("~"):
        return (
            "begins with '~', which Python does not expand (it would name a folder '~' in the working "
            f"directory): pass os.path.expanduser({text!r})"
        )
    name = os.path.basename(text.rstrip(os.sep))
    if name.strip() != name:
        return f"names {name!r}, blank or with spaces around it: surely a mistake"
    return None


def _sibling(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}{_TAG}{kind}-{secrets.token_hex(6)}"


def _siblings(path: Path) -> list[Path]:
    """The hidden folders saves of ``path`` left beside it (new, old, unfinished)."""
    prefix = f".{path.name}{_TAG}"
    with contextlib.suppress(OSError):
        return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix))
    return []


@contextlib.contextmanager
def _os_errors(what: str) -> Iterator[None]:
    """An ``OSError`` inside as a :class:`CheckpointError` saying ``what`` failed, with it as the cause."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"{what}: {exc}") from exc


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(folder: Path) -> None:
    """Remove ``folder``, its manifest first: a folder half removed never looks complete (a link to a
    folder: the link alone)."""
    with contextlib.suppress(OSError):
        os.unlink(folder if folder.is_symlink() else folder / MANIFEST)
    shutil.rmtree(folder, ignore_errors=True)


# --- saving -------------------------------------------------------------------------------------
def new_folder(path: Path) -> Path:
    """Create the hidden sibling a save of ``path`` writes into (the first rank only). ``path``
    itself must be missing, an empty folder or a checkpoint: anything else is not replaced."""
    with _os_errors(f"cannot save a checkpoint at {path}"):
        inside = next((p for p in path.parents if (p / MANIFEST).is_file()), None)
        if inside is not None:
            raise CheckpointError(
                f"cannot save a checkpoint at {path}: it lies inside the checkpoint {inside}, whose next "
                "save would remove it: save beside it instead"
            )
        if path.is_dir():
            if any(path.iterdir()) and not (path / MANIFEST).is_file():
                raise CheckpointError(
                    f"cannot save a checkpoint at {path}: the folder holds files save_checkpoint did "
                    f"not write (no {MANIFEST}); it is left as it is: remove it or save elsewhere"
                )
            _check_only_own(path)
        elif path.exists() or path.is_symlink():
            raise CheckpointError(
                f"cannot save a checkpoint at {path}: it is a file, not a checkpoint's folder"
            )
    staged = _sibling(path, "new")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged.mkdir()
    except OSError as exc:
        raise CheckpointError(
            f"cannot save a checkpoint at {path}: cannot create the folder {staged}: {exc}"
        ) from exc
    return staged


def _check_only_own(path: Path) -> None:
    """Refuse to replace the checkpoint ``path`` if it holds entries its manifest does not list (a file
    someone put there, which the switch would remove); a manifest that cannot be read is a damaged
    checkpoint, replaced."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        listed = set(json.loads((path / MANIFEST).read_text())["files"]) | {MANIFEST}
        others = sorted(p.name for p in path.iterdir() if p.name not in listed)
        if others:
            raise CheckpointError(
                f"cannot save a checkpoint at {path}: the checkpoint there also holds {others[0]!r}"
                f"{f' (and {len(others) - 1} more)' if len(others) > 1 else ''}, which save_checkpoint did "
                "not write and replacing it would remove: move it out, or save elsewhere"
            )


def own_files(folder: Path, rank: int) -> list[str]:
    """The data files rank ``rank`` wrote into ``folder`` (DCP names them ``__<rank>_<i>.distcp``)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_"))


def digests(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Each file's size and sha256: what the manifest records."""
    out = {}
    for name in names:
        sha = hashlib.sha256()
        size = 0
        with open(folder / name, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
        out[name] = {"bytes": size, "sha256": sha.hexdigest()}
    return out


def commit(
    staged: Path, path: Path, reported: dict[str, dict[str, Any]], step: int, optimizer: str | None
) -> None:
    """Complete ``staged`` with its manifest and switch it in at ``path`` (module docstring).

    ``reported``: the ranks' digests of the files they wrote; the first rank digests the rest.
    ``optimizer``: the class name of the optimizer saved, or None.
    """
    try:
        present = {p.name for p in staged.iterdir()}
        unseen = sorted(set(reported) - present)
        if unseen:
            raise CheckpointError(
                f"cannot save a checkpoint at {path}: {unseen[0]}, written by another rank, is not in "
                f"{staged} as the first rank sees it: the folder must be on storage every rank shares"
            )
        files = {**digests(staged, sorted(present - set(reported))), **reported}
        manifest = {"format": FORMAT, "step": step, "optimizer": optimizer, "created_ns": time.time_ns()}
        _fsync_folder(staged)
        _write_json(staged / MANIFEST, {**manifest, "files": dict(sorted(files.items()))})
    except (OSError, CheckpointError) as exc:
        discard(staged)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"cannot save a checkpoint at {path}: {exc}; nothing there changed") from exc
    try:
        if path.exists() or path.is_symlink():
            os.rename(path, _sibling(path, "old"))
        os.rename(staged, path)
        _fsync_folder(path.parent)
    except OSError as exc:
        raise CheckpointError(
            f"cannot switch the new checkpoint in at {path}: {exc}; load_checkpoint({str(path)!r}) reads "
            f"the previous checkpoint or the new one (kept beside it as {staged.name})"
        ) from exc
    for leftover in _siblings(path):
        discard(leftover)


def _write_json(target: Path, value: dict[str, Any]) -> None:
    """``value`` as ``target``, whole or not at all: written beside it, synced, renamed over it."""
    part = target.with_name(target.name + ".part")
    with open(part, "w") as f:
        f.write(json.dumps(value, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, target)
    _fsync_folder(target.parent)


# --- loading ------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict[str, Any]:
    """``folder``'s manifest, checked to be one :func:`commit` wrote, and every file it lists present
    with its size (the checksums are :func:`verify`'s)."""
    where = folder / MANIFEST
    with _os_errors(f"cannot read the checkpoint at {folder}"):
        is_file = (folder.exists() or folder.is_symlink()) and not folder.is_dir()
    if is_file:
        raise CheckpointError(f"{folder} is a file, not a checkpoint's folder")
    if not where.is_file():
        raise CheckpointError(
            f"{folder} is not a complete checkpoint: it has no {MANIFEST} (save_checkpoint writes it "
            "last: the save was cut short, or the folder was not written by save_checkpoint)"
        )
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {where}: {exc}") from exc
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{where} is not a manifest save_checkpoint wrote: {problem}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(
            f"checkpoint {folder} has format {manifest['format']}, this autopar reads format {FORMAT}"
        )
    for name, entry in manifest["files"].items():
        try:
            size = (folder / name).stat().st_size
        except OSError as exc:
            raise CheckpointError(f"checkpoint {folder}: {name}, listed in {MANIFEST}, is missing") from exc
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} is {size} bytes, {MANIFEST} records {entry['bytes']} "
                "(truncated, or changed after it was saved)"
            )
    return manifest


def _manifest_problem(manifest: object) -> str | None:
    """What makes ``manifest`` (parsed JSON) other than :func:`commit` writes it, or None."""
    if not isinstance(manifest, dict) or set(manifest) != _KEYS:
        keys = sorted(manifest) if isinstance(manifest, dict) else type(manifest).__name__
        return f"expected the keys {sorted(_KEYS)}, found {keys}"
    if not is_int(manifest["format"]) or not is_int(manifest["step"]) or manifest["step"] < 0:
        return f"format {manifest['format']!r} and step {manifest['step']!r} must be ints >= 0"
    if manifest["optimizer"] is not None and not isinstance(manifest["optimizer"], str):
        return f"optimizer {manifest['optimizer']!r} must be a class name or null"
    files = manifest["files"]
    if not isinstance(files, dict) or ".metadata" not in files:
        return "its files must include DCP's .metadata"
    for name, entry in files.items():
        plain = name not in ("", ".", "..") and "/" not in name and os.sep not in name
        if not plain or not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}:
            return f"file {name!r}: expected a plain name with bytes and sha256"
        if not is_int(entry["bytes"]) or entry["bytes"] < 0 or not isinstance(entry["sha256"], str):
            return f"file {name!r}: bytes must be an int >= 0 and sha256 a hex string"
    return None


def verify(folder: Path, manifest: dict[str, Any]) -> None:
    """Check this rank's share of the files against their sha256 in the manifest (each rank reads
    every ``size``-th file: together they read each once)."""
    rank, size = ranks()
    names = sorted(manifest["files"])[rank::size]
    with _os_errors(f"cannot read the checkpoint at {folder}"):
        found = digests(folder, names)
    for name, entry in found.items():
        if entry["sha256"] != manifest["files"][name]["sha256"]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} does not match its sha256 in {MANIFEST} (its bytes "
                "changed after it was saved: bit rot, or an incomplete copy)"
            )


def check_entries(
    folder: Path, saved: dict[str, Any], expected: dict[str, Any], prefix: str, owner: str
) -> None:
    """Every rank's ``expected`` entries (flat DCP keys under ``prefix``) are in the checkpoint with their
    shapes and dtypes, and it holds none under ``prefix`` that no rank expects (under a pipeline
    each rank holds its stages' only)."""
    error = None
    try:
        _check_present(folder, saved, expected, prefix, owner)
    except CheckpointError as exc:
        error = exc
    agree(error)
    keys = sorted(key for key in saved if key.startswith(prefix))
    extra = [key for key, seen in zip(keys, any_rank([k in expected for k in keys])) if not seen]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"checkpoint {folder} holds '{extra[0][len(prefix) :]}'{more}, which {owner} does not have: "
            "it was saved from another model or optimizer"
        )


def _check_present(
    folder: Path, saved: dict[str, Any], expected: dict[str, Any], prefix: str, owner: str
) -> None:
    missing = sorted(key for key in expected if key not in saved)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        name = missing[0][len(prefix) :]
        raise CheckpointError(
            f"checkpoint {folder} has no '{name}'{more} of {owner}: "
            "it was saved from another model or optimizer"
        )
    for key, value in expected.items():
        meta, name = saved[key], key[len(prefix) :]
        if isinstance(value, torch.Tensor):
            have = (tuple(value.shape), value.dtype)
            ok = isinstance(meta, TensorStorageMetadata) and (tuple(meta.size), meta.properties.dtype) == have
            if not ok:
                was = (
                    f"{tuple(meta.size)} {meta.properties.dtype}"
                    if isinstance(meta, TensorStorageMetadata)
                    else "not a tensor"
                )
                raise CheckpointError(
                    f"'{name}' is {was} in checkpoint {folder}, but {have[0]} {have[1]} in {owner}"
                )
        elif not isinstance(meta, BytesStorageMetadata):
            raise CheckpointError(f"'{name}' is a tensor in checkpoint {folder}, but {value!r} in {owner}")


def resolve(path: Path) -> Path:
    """The folder holding the last complete checkpoint saved at ``path``: ``path`` itself, or while a
    save's switch was cut between its renames (``path`` missing) the newest complete sibling."""
    with _os_errors(f"cannot read the checkpoint at {path}"):
        if path.exists() or path.is_symlink():
            return path
    complete = []
    for sibling in _siblings(path):
        with contextlib.suppress(CheckpointError):
            complete.append((read_manifest(sibling)["created_ns"], sibling))
    if not complete:
        raise CheckpointError(f"no checkpoint at {path}: save_checkpoint writes a folder there")
    return max(complete)[1]


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a checkpoint ``load_checkpoint`` can read: a manifest, with every file it
    lists present at its recorded size (their checksums are checked when it is loaded).

    Args:
        path: the folder given to ``save_checkpoint``.

    Raises:
        CheckpointError: if ``path`` is not a non-empty str or os.PathLike.
    """
    where = checkpoint_path(path, "is_complete")
    try:
        read_manifest(resolve(where))
    except CheckpointError:
        return False
    return True


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint in ``folder`` (one of its entries) of the highest step (the latest
    saved among equal steps), or None if there is none or no ``folder``.

    Unfinished folders are skipped; a checkpoint whose save was cut between its two renames is
    found under its own name (``load_checkpoint`` of that name reads it).

    Args:
        folder: the folder whose entries are checkpoints (``ckpt`` for ``ckpt/step-200``).

    Raises:
        CheckpointError: if ``folder`` is not a non-empty str or os.PathLike, is a file, or cannot
            be listed.
    """
    root = checkpoint_path(folder, "latest_checkpoint")
    with _os_errors(f"latest_checkpoint: cannot list {root}"):
        if not root.exists():
            return None
        if not root.is_dir():
            raise CheckpointError(f"latest_checkpoint: {root} is a file, not a folder of checkpoints")
        names = {p.name.split(_TAG)[0][1:] if _TAG in p.name else p.name for p in root.iterdir()}
    found = []
    for name in sorted(names):
        with contextlib.suppress(CheckpointError):
            manifest = read_manifest(resolve(root / name))
            found.append((manifest["step"], manifest["created_ns"], root / name))
    return max(found)[2] if found else None
