"""The whole training state in one checkpoint, loadable under another plan: save, crash, resume.

:func:`save_checkpoint` writes, with ``torch.distributed.checkpoint`` (every rank its pieces,
in parallel), a compiled module's parameters and buffers, its optimizer's state, the step,
the random number generators' states and the plan it trained under; :func:`load_checkpoint`
reads it back into a module and optimizer compiled from the same model under **any** plan
(another mesh, ZeRO stage, tensor or pipeline split) and returns the step.

Everything is stored in the model's own terms, so DCP can reshard it:

* parameters and buffers as ``state_dict()`` hands them out (the model's shapes, each
  rank's piece one block: ``autopar.runtime.checkpoint``);
* each optimizer state tensor (Adam's moments, SGD's momentum) keyed by the parameter it
  belongs to, ``optimizer.state.<fqn>.<name>``, as a DTensor shaped like that parameter,
  wherever the plan keeps it: on the parameter, on a ZeRO-1/2 shard (its extra ``Shard``), on
  an fp32 host master copy (offload: its piece is wrapped in the placements of what it
  copies); a 0-d state (Adam's ``step``) as it is;
* the optimizer's hyperparameters per group (``lr``, ``betas``, ...), the step, the CPU (and
  CUDA) generator state of the first rank, and the plan as JSON text.

Only tensors, numbers, strings, lists and dicts are written, so every file loads with
``torch.load(..., weights_only=True)``. The folder, its manifest of checksums and the atomic
switch are :mod:`autopar.runtime.checkpoint_files`'.

A load changes nothing until everything has been read: the manifest, every file's checksum,
the keys, shapes and dtypes (DCP's metadata) and the optimizer's class are checked first, the
values are read into fresh tensors, and only then copied into the module and optimizer. An
optimizer whose state is created lazily (Adam's, on its first ``step()``) is given it first for
the parameters that lack it, by one step with zero gradients at learning rate 0 (the others'
gradients set aside meanwhile, so their state is untouched); a failed load removes that state
again. Host master copies (offload) are refreshed from the loaded parameters.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from autopar.ir.arguments import is_int, plain_number
from autopar.ir.errors import CheckpointError
from autopar.runtime import checkpoint_files as files
from autopar.runtime.checkpoint import handed_out, taken_back
from autopar.runtime.materialize import as_dtensor
from autopar.runtime.module import DistributedModule
from autopar.runtime.optimizer import gradient_holders, refresh_copies, stands_for
from autopar.runtime.ranks import gathered, ranks

FORMAT = files.FORMAT
_STATE = files.OPTIMIZER_STATE
_GROUPS = "optimizer.param_groups."


class _Entry(NamedTuple):
    """One optimizer state value: in the model's terms, live, its DTensor form (None for a 0-d or
    non-tensor state), the tensor the optimizer steps and the state's name."""

    value: Any
    live: Any
    form: DTensor | None
    held: torch.Tensor
    name: str


Entries = dict[str, _Entry]  # "<fqn>.<name>" -> the entry


def save_checkpoint(
    path: str | Path, module: Any, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0
) -> None:
    """Write ``module``'s and ``optimizer``'s whole state, ``step`` and the RNG states as the checkpoint
    ``path`` (a folder; every rank calls this). See the module docstring for what is stored.

    ``path`` names the new checkpoint only once it is complete: a save that fails or is killed
    leaves the previous checkpoint there as it was (``autopar.runtime.checkpoint_files``).

    Args:
        path: the checkpoint's folder: missing, empty, or a checkpoint, which is replaced.
        module: a module ``autopar.compile`` returned.
        optimizer: its optimizer (``module.optimizer(...)``), or None to save the module alone.
        step: the training step to resume at, an int >= 0 (a numpy integer too; not a float or a tensor).

    Raises:
        CheckpointError: for any failure, on every rank, with the OS's or torch's error as cause.
    """
    target, step = _agreed(_checked_save_arguments, path, module, optimizer, step)
    entries = _optimizer_entries(module, optimizer, _held(module, optimizer)) if optimizer else {}
    state = _template(module, optimizer, entries)
    state.update(step=step, rng=_rng_states(), plan=json.dumps(module.plan.to_dict()))
    staged = Path(files.on_first_rank(lambda: str(files.new_folder(target))))
    rank, size = ranks()
    error, mine = None, {}
    try:
        writer = dcp.FileSystemWriter(staged, sync_files=True, single_file_per_rank=True, thread_count=1)
        with _single_process_quiet():
            dcp.save(state, storage_writer=writer, no_dist=size == 1)
        mine = files.digests(staged, files.own_files(staged, rank))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's and the OS's, reported
        error = _failure(f"cannot save a checkpoint at {target}; the previous one there is unchanged", exc)
    reports = gathered((None if error is None else str(error), mine))
    messages = [message for message, _ in reports if message is not None]
    written = {name: entry for _, digests in reports for name, entry in digests.items()}

    def finish() -> None:
        if messages:
            files.discard(staged)
            raise CheckpointError(messages[0])
        files.commit(staged, target, written, step, _kind(optimizer))

    try:
        files.on_first_rank(finish)
    except CheckpointError:
        if error is not None:
            raise error from error.__cause__  # this rank's own, with its cause
        raise


def load_checkpoint(path: str | Path, module: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Read a checkpoint written by :func:`save_checkpoint` into ``module`` and ``optimizer`` (compiled
    under any plan) and return its step; the RNG states are restored too. Every rank calls this.

    Nothing changes unless the whole checkpoint loads (module docstring).

    Args:
        path: the checkpoint's folder, as given to ``save_checkpoint``.
        module: a module ``autopar.compile`` returned, from the model the checkpoint was saved from.
        optimizer: an optimizer of the class saved, or None to load the module alone.

    Raises:
        CheckpointError: on every rank, naming the file, key or value that differs, and changing
            nothing: a missing or unfinished checkpoint, a file whose checksum differs, a key
            missing or extra, another shape or dtype, another optimizer class.
    """
    folder, manifest, saved = _agreed(_opened, path, module, optimizer)
    model = module.state_dict()
    files.check_entries(folder, saved, {f"model.{k}": v for k, v in model.items()}, "model.", "this module")
    state: dict[str, Any] = {"model": {k: _fresh(v) for k, v in model.items()}, "rng": _rng_template(saved)}
    undo, entries = _prepare_optimizer(folder, saved, module, optimizer, state)
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=ranks()[1] == 1)
    except BaseException as exc:
        undo()
        if not isinstance(exc, Exception | CheckpointException):
            raise  # an interrupt: as it is, with nothing changed
        error = _failure(f"cannot load the checkpoint at {folder}; nothing was changed", exc)
        raise error from error.__cause__
    module.load_state_dict(state["model"])
    if optimizer is not None:
        refresh_copies(optimizer)
        _put_optimizer_state(module, optimizer, state["optimizer"], entries)
    _set_rng_states(state["rng"])
    return manifest["step"]


# --- checks before anything changes -------------------------------------------------------------
def _agreed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, whose :class:`CheckpointError` on any rank is raised on every rank."""
    result, error = None, None
    try:
        result = fn(*args)
    except CheckpointError as exc:
        error = exc
    files.agree(error)
    return result


def _checked_arguments(caller: str, path: object, module: object, optimizer: object) -> Path:
    """The checkpoint's absolute path, once ``module`` and ``optimizer`` are what ``caller`` takes."""
    if not isinstance(module, DistributedModule):
        hint = ""
        if isinstance(module, torch.optim.Optimizer):
            hint = ": the module goes before the optimizer"
        elif isinstance(module, torch.nn.Module):
            hint = ": compile it first (autopar.compile(model, mesh, example_args))"
        raise CheckpointError(
            f"{caller}'s module must be a module autopar.compile returned, got {type(module).__name__}{hint}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(
            f"{caller}'s optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    target = files.checkpoint_path(path, caller)
    if optimizer is not None:
        _held(module, optimizer)
    return target


def _checked_save_arguments(
    path: object, module: object, optimizer: object, step: object
) -> tuple[Path, int]:
    """The checkpoint's absolute path and the step as a Python int, once every argument is valid."""
    target = _checked_arguments("save_checkpoint", path, module, optimizer)
    number = plain_number(step)
    if not is_int(number) or number < 0:
        hint = ": pass an int (step.item())" if isinstance(step, torch.Tensor) else ""
        raise CheckpointError(
            f"save_checkpoint's step must be an int >= 0, got {type(step).__name__} {step!r}{hint}"
        )
    return target, number


def _opened(path: object, module: object, optimizer: object) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The checkpoint's folder, manifest and DCP metadata, once the files match their checksums and
    the checkpoint's optimizer class and groups are ``optimizer``'s."""
    folder = files.resolve(_checked_arguments("load_checkpoint", path, module, optimizer))
    manifest = files.read_manifest(folder)
    saved_kind, kind = manifest["optimizer"], _kind(optimizer)
    if kind is not None and saved_kind != kind:
        what = f"with the optimizer {saved_kind}" if saved_kind else "without an optimizer"
        raise CheckpointError(
            f"checkpoint {folder} was saved {what}, but load_checkpoint was given {kind}"
            + ("" if saved_kind else ": it holds no optimizer state to load (pass optimizer=None)")
        )
    files.verify(folder, manifest)
    try:
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - whatever unpickling a damaged file raises
        raise CheckpointError(f"cannot read {folder / '.metadata'}: {type(exc).__name__}: {exc}") from exc
    if "rng.cpu" not in saved:
        raise CheckpointError(f"checkpoint {folder} has no rng.cpu: it was not written by save_checkpoint")
    if kind is not None:
        groups = len({key[len(_GROUPS) :].split(".")[0] for key in saved if key.startswith(_GROUPS)})
        if groups != len(optimizer.param_groups):
            raise CheckpointError(
                f"checkpoint {folder} holds {groups} optimizer parameter groups, the optimizer given has "
                f"{len(optimizer.param_groups)}"
            )
    return folder, manifest, saved


# --- the state in the model's terms -------------------------------------------------------------
def _kind(optimizer: torch.optim.Optimizer | None) -> str | None:
    """The optimizer's class as the manifest records it, or None."""
    return None if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _held(module: Any, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str]]:
    """Each tensor ``optimizer`` steps, with the name of the parameter its state belongs to."""
    fqn_of = {id(p): fqn for fqn, p in module.named_parameters()}
    fqn_of.update({id(s.shard): fqn_of[id(s.param)] for s in module.zero_shards.values()})
    out = []
    for group in optimizer.param_groups:
        for held in group["params"]:
            fqn = fqn_of.get(id(stands_for(optimizer, held)))
            if fqn is None:
                raise CheckpointError(
                    f"the optimizer steps a tensor of shape {tuple(held.shape)} that is no parameter of this "
                    "module: build it with module.optimizer(...)"
                )
            out.append((held, fqn))
    return out


def _template(module: Any, optimizer: torch.optim.Optimizer | None, entries: Entries) -> dict[str, Any]:
    """The state dict in the model's terms (module docstring) that DCP saves."""
    state: dict[str, Any] = {"format": FORMAT, "model": module.state_dict()}
    if optimizer is not None:
        state["optimizer"] = {
            "state": {key: entry.value for key, entry in entries.items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        }
    return state


def _optimizer_entries(
    module: Any, optimizer: torch.optim.Optimizer, held: list[tuple[torch.Tensor, str]]
) -> Entries:
    """The optimizer's state values, by parameter and name (see :class:`_Entry`)."""
    entries = {}
    for tensor, fqn in held:
        source = stands_for(optimizer, tensor)
        manual = module.plan.manual_rows.get(fqn)
        for name, live in optimizer.state.get(tensor, {}).items():
            if not isinstance(live, torch.Tensor) or live.ndim == 0:
                entries[f"{fqn}.{name}"] = _Entry(live, live, None, tensor, name)
                continue
            mesh, placements = source.device_mesh, source.placements
            form = live if isinstance(live, DTensor) else as_dtensor(live, mesh, placements, source)
            entries[f"{fqn}.{name}"] = _Entry(handed_out(form, manual), live, form, tensor, name)
    return entries


def _prepare_optimizer(
    folder: Path, saved: dict[str, Any], module: Any, optimizer: torch.optim.Optimizer | None, state: dict
) -> tuple[Callable[[], None], Entries]:
    """Check the optimizer's state against the checkpoint and add fresh tensors to load it into to
    ``state``; returns what undoes the state created for that (:func:`_ensure_state`) and the
    entries loaded: those of the parameters the checkpoint holds state of."""
    if optimizer is None:
        return _nothing, {}
    held = _held(module, optimizer)
    stepped = {key[len(_STATE) :].rsplit(".", 1)[0] for key in saved if key.startswith(_STATE)}
    undo, error = _nothing, None
    try:
        undo = _ensure_state(optimizer, [tensor for tensor, fqn in held if fqn in stepped])
    except CheckpointError as exc:
        error = exc
    try:
        files.agree(error)
        entries = {
            key: entry
            for key, entry in _optimizer_entries(module, optimizer, held).items()
            if key.rsplit(".", 1)[0] in stepped
        }
        expected = {_STATE + key: entry.value for key, entry in entries.items()}
        files.check_entries(folder, saved, expected, _STATE, f"the optimizer ({_kind(optimizer)})")
    except CheckpointError:
        undo()
        raise
    names: dict[int, list[str]] = {}
    for key in saved:
        if key.startswith(_GROUPS):
            index, name = key[len(_GROUPS) :].split(".", 1)
            names.setdefault(int(index), []).append(name)
    state["optimizer"] = {
        "state": {key: _fresh(entry.value) for key, entry in entries.items()},
        "param_groups": [
            {n: g.get(n) for n in names.get(i, [])} for i, g in enumerate(optimizer.param_groups)
        ],
    }
    return undo, entries


def _put_optimizer_state(
    module: Any, optimizer: torch.optim.Optimizer, loaded: dict[str, Any], entries: Entries
) -> None:
    """Copy the loaded values (in the model's terms) into the optimizer's live state; a parameter the
    checkpoint holds no state of is left without."""
    kept = {id(entry.held) for entry in entries.values()}
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            if id(tensor) not in kept:
                optimizer.state.pop(tensor, None)
    with torch.no_grad():
        for key, entry in entries.items():
            value = loaded["state"][key]
            if entry.form is None:
                if isinstance(entry.live, torch.Tensor) and isinstance(value, torch.Tensor):
                    entry.live.copy_(value)
                else:
                    optimizer.state[entry.held][entry.name] = value
                continue
            fqn = key.rsplit(".", 1)[0]
            local = taken_back(value, entry.form, module.plan.manual_rows.get(fqn)).to_local()
            (entry.live.to_local() if isinstance(entry.live, DTensor) else entry.live).copy_(local)
    for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
        group.update(saved)


def _nothing() -> None:
    """Undo nothing."""


def _ensure_state(optimizer: torch.optim.Optimizer, needed: list[torch.Tensor]) -> Callable[[], None]:
    """Give the tensors of ``needed`` that have no state yet (a lazily initialised optimizer's) their
    state: one step with zero gradients at learning rate 0, every other gradient set aside meanwhile
    so nothing else is stepped. Returns what removes that state again."""
    lacking = [p for p in needed if not optimizer.state.get(p)]
    if not lacking:
        return _nothing

    def undo() -> None:
        for p in lacking:
            optimizer.state.pop(p, None)

    every = [*gradient_holders(optimizer), *(p for g in optimizer.param_groups for p in g["params"])]
    grads = {id(t): (t, t.grad) for t in every}
    rates = [g.get("lr") for g in optimizer.param_groups]
    try:
        for t, _ in grads.values():
            t.grad = None
        for p in lacking:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = 0.0
        optimizer.step()
    except Exception as exc:  # noqa: BLE001 - any optimizer's step, reported
        undo()
        raise CheckpointError(
            f"cannot create the state of {_kind(optimizer)} to load into: its step() failed: {exc}"
        ) from exc
    finally:
        for g, lr in zip(optimizer.param_groups, rates):
            if lr is not None:
                g["lr"] = lr
        for t, grad in grads.values():
            t.grad = grad
    return undo


def _fresh(value: Any) -> Any:
    """A new tensor like ``value`` (a DTensor with its placements) for DCP to load into; not a tensor:
    ``value`` itself, which DCP replaces."""
    if isinstance(value, DTensor):
        local = torch.zeros_like(value.to_local())
        return as_dtensor(local, value.device_mesh, value.placements, value)
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value


def _failure(what: str, exc: BaseException) -> CheckpointError:
    """``exc`` (DCP's ``CheckpointException`` wraps each rank's own error) as a :class:`CheckpointError`
    saying ``what``, with the first underlying error as its cause."""
    cause = exc
    if isinstance(exc, CheckpointException):
        inner = [
            f[0] for f in exc.failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException)
        ]
        cause = inner[0] if inner else exc
    # torch.save's writer reports a failed write (a full disk) as "unexpected pos", with the OS's
    # error as its context: that one says what happened
    chain, link = [], cause
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    cause = next((e for e in chain if isinstance(e, OSError)), cause)
    if isinstance(cause, CheckpointError):
        return cause
    error = CheckpointError(f"{what}: {type(cause).__name__}: {cause}")
    error.__cause__ = cause
    return error


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP without collectives (a world of one) warns that it assumes one process: it is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _rng_template(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Fresh tensors for the generator states the checkpoint holds and this process has."""
    return {k: torch.zeros_like(v) for k, v in _rng_states().items() if f"rng.{k}" in saved}


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
