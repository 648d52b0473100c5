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
``torch.load(..., weights_only=True)``. An optimizer whose state is created lazily (Adam's, on
its first ``step()``) is given it first by one step with zero gradients at learning rate 0,
then overwritten with the saved values; host master copies (offload) are refreshed from the
loaded parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from autopar.ir.errors import CheckpointError
from autopar.runtime.checkpoint import handed_out, taken_back
from autopar.runtime.materialize import as_dtensor
from autopar.runtime.optimizer import refresh_copies, stands_for

FORMAT = 1

# "<fqn>.<name>" -> (an optimizer state in the model's terms, the live state tensor, its DTensor form)
Entries = dict[str, tuple[Any, Any, Any]]


def save_checkpoint(
    path: str | Path, module: Any, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0
) -> None:
    """Write ``module``'s and ``optimizer``'s whole state, ``step`` and the RNG states under ``path``
    (a folder; every rank calls this). See the module docstring for what is stored."""
    state = _template(module, optimizer, _optimizer_entries(module, optimizer) if optimizer else {})
    state["step"] = int(step)
    state["rng"] = _rng_states()
    state["plan"] = json.dumps(module.plan.to_dict())
    dcp.save(state, checkpoint_id=str(path))


def load_checkpoint(path: str | Path, module: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Read a checkpoint written by :func:`save_checkpoint` into ``module`` and ``optimizer``
    (compiled under any plan) and return its step; the RNG states are restored too."""
    if not Path(path).is_dir():
        raise CheckpointError(f"no checkpoint at {path}: save_checkpoint writes a folder there")
    if optimizer is not None:
        _ensure_state(optimizer)
    entries = _optimizer_entries(module, optimizer) if optimizer is not None else {}
    state = _template(module, optimizer, entries)
    state.update(step=0, rng=_rng_states())
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # noqa: BLE001 - DCP's many failures, reported with the folder
        raise CheckpointError(f"cannot load the checkpoint at {path} into this module: {exc}") from None
    if state["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {state['format']}, this autopar reads {FORMAT}")
    module.load_state_dict(state["model"])
    if optimizer is not None:
        refresh_copies(optimizer)
        _put_optimizer_state(module, optimizer, state, entries)
    _set_rng_states(state["rng"])
    return int(state["step"])


def _template(module: Any, optimizer: torch.optim.Optimizer | None, entries: Entries) -> dict[str, Any]:
    """The state dict in the model's terms (module docstring); DCP saves it or loads into it.
    ``entries``: the optimizer's, from :func:`_optimizer_entries`."""
    state: dict[str, Any] = {"format": FORMAT, "model": module.state_dict()}
    if optimizer is not None:
        state["optimizer"] = {
            "state": {key: value for key, (value, _, _) in entries.items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        }
    return state


def _optimizer_entries(module: Any, optimizer: torch.optim.Optimizer) -> Entries:
    """The optimizer's state tensors, by parameter and name (see :data:`Entries`)."""
    fqn_of = {id(p): fqn for fqn, p in module.named_parameters()}
    fqn_of.update({id(s.shard): fqn_of[id(s.param)] for s in module.zero_shards.values()})
    entries = {}
    for group in optimizer.param_groups:
        for held in group["params"]:
            source = stands_for(optimizer, held)
            fqn = fqn_of.get(id(source))
            if fqn is None:
                raise CheckpointError("the optimizer steps a tensor that is no parameter of this module")
            manual = module.plan.manual_rows.get(fqn)
            for name, live in optimizer.state.get(held, {}).items():
                if not isinstance(live, torch.Tensor) or live.ndim == 0:
                    entries[f"{fqn}.{name}"] = (live, live, None)
                    continue
                mesh, placements = source.device_mesh, source.placements
                form = live if isinstance(live, DTensor) else as_dtensor(live, mesh, placements, source)
                entries[f"{fqn}.{name}"] = (handed_out(form, manual), live, form)
    return entries


def _put_optimizer_state(
    module: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any], entries: Entries
) -> None:
    """Copy the loaded values (in the model's terms) into the optimizer's live state (``entries``)."""
    loaded = state["optimizer"]["state"]
    with torch.no_grad():
        for key, (_, live, form) in entries.items():
            value = loaded[key]
            if form is None:
                if isinstance(live, torch.Tensor):
                    live.copy_(value)
                continue
            fqn = key.rsplit(".", 1)[0]
            local = taken_back(value, form, module.plan.manual_rows.get(fqn)).to_local()
            (live.to_local() if isinstance(live, DTensor) else live).copy_(local)
    for group, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
        group.update(saved)


def _ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a lazily initialised optimizer its state: one step with zero gradients at learning rate 0."""
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in held):
        return
    rates = [g.get("lr") for g in optimizer.param_groups]
    zeroed = [p for p in held if p.grad is None]
    for p in zeroed:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, rates):
        if lr is not None:
            g["lr"] = lr
    for p in zeroed:
        p.grad = None


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
