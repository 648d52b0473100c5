"""Dynamic loss scaling for fp16 training, agreed on by every rank.

fp16 keeps 10 bits of mantissa and a narrow exponent: small gradients underflow to zero in
the backward's fp16 region. Multiplying the loss by a large power of two keeps them in
range; the fp32 master gradients are divided back before the optimizer steps. When any
rank finds an inf or NaN among its gradients the scale was too large: every rank skips
the step (its gradients dropped) and halves the scale; after ``growth_interval`` good
steps in a row the scale doubles. This is ``torch.amp.GradScaler``'s policy, with the
overflow check summed over the world, because a rank holds only its pieces of split
gradients and one rank stepping while another skips would leave the replicas different.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.ir.arguments import check_instance, check_int, check_keys, check_number, plain_number
from autopar.ir.errors import OptionError
from autopar.runtime.optimizer import gradient_holders

# The largest scale: float32's largest value. A larger one makes every fp32 scaled loss inf (every
# step skipped); growth stops there, and a larger init_scale is refused.
MAX_SCALE = torch.finfo(torch.float32).max
# The smallest: float32's smallest normal value. Below it a loss times the scale underflows to 0 in
# fp32 and dividing by it overflows; backing off stops there, and a smaller init_scale is refused.
MIN_SCALE = torch.finfo(torch.float32).tiny
_STATE_KEYS = ("scale", "good_steps", "skipped_steps")


class LossScaler:
    """Scales the loss up for backward and the gradients down before the step (see module docstring).

    Use it as ``torch.amp.GradScaler``: ``scaler.scale(loss).backward()`` (or
    ``dmodel.train_step(..., loss_scaler=scaler)``), optionally ``scaler.unscale_(optimizer)``
    before clipping, then ``scaler.step(optimizer)`` and ``scaler.update()``. ``optimizer``
    is one ``DistributedModule.optimizer`` made (it knows where ZeRO and offload keep the
    gradients). Powers of two leave the unscaled gradients exactly those of an unscaled loss
    wherever nothing underflowed or overflowed.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        """Each argument is checked as given: a bool, a string, a tensor or a non-finite number is an
        :class:`~autopar.ir.errors.OptionError` naming it (a scale of inf would skip every step);
        numpy numbers are taken as the Python numbers they equal.

        Args:
            init_scale: the first step's scale, a number in [:data:`MIN_SCALE`, :data:`MAX_SCALE`].
            growth_factor: the scale's factor after ``growth_interval`` good steps, a finite number > 1.
            backoff_factor: its factor after an overflow, a number in (0, 1).
            growth_interval: good steps in a row before the scale grows, an int >= 1.
        """
        self.scale_value = float(_check_scale(init_scale, "LossScaler(init_scale=...)"))
        growth = check_number(plain_number(growth_factor), "LossScaler(growth_factor=...)", minimum=1.0)
        backoff = check_number(plain_number(backoff_factor), "LossScaler(backoff_factor=...)", below=1.0)
        self.growth_factor, self.backoff_factor = float(growth), float(backoff)
        self.growth_interval = check_int(
            plain_number(growth_interval), "LossScaler(growth_interval=...)", minimum=1
        )
        self.good_steps = 0
        self.skipped_steps = 0
        self._found_inf: bool | None = None  # this step's verdict, once unscaled
        self._stepped = False  # whether step() ran since the last update()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale, for ``.backward()``.

        Args:
            loss: the step's loss: a floating-point tensor of one element (a number has no backward).
        """
        if not isinstance(loss, torch.Tensor):
            raise OptionError(
                f"LossScaler.scale(loss) takes the loss tensor to call backward() on, got "
                f"{type(loss).__name__} {loss!r}"
            )
        if not loss.is_floating_point() or loss.numel() != 1:
            raise OptionError(
                "LossScaler.scale(loss) takes the loss, a floating-point tensor of one element, got a "
                f"{loss.dtype} tensor of shape {tuple(loss.shape)}: reduce it first (loss.mean(), loss.sum())"
            )
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide this step's gradients by the scale, in place; whether any rank found inf or NaN.

        Once per step: a second call returns the first verdict without dividing again.
        """
        check_instance(
            optimizer,
            torch.optim.Optimizer,
            "LossScaler's optimizer",
            "a torch optimizer (dmodel.optimizer(...))",
        )
        if self._found_inf is not None:
            return self._found_inf
        grads = [h.grad for h in gradient_holders(optimizer) if h.grad is not None]
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        # on the gradients' device: NCCL sums only what lives on the GPU
        local_inf = torch.zeros((), device=locals_[0].device if locals_ else "cpu")
        for local in locals_:
            local.mul_(1.0 / self.scale_value)
            local_inf = torch.maximum(local_inf, (~torch.isfinite(local)).any().float())
        if dist.is_initialized():
            dist.all_reduce(local_inf, op=dist.ReduceOp.MAX)
        self._found_inf = bool(local_inf.item())
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (unless done) and step ``optimizer``, or skip the step and drop the gradients
        on every rank when any rank overflowed; whether it stepped. Once per step: a second call
        before :meth:`update` is an :class:`~autopar.ir.errors.OptionError` (it would step again on
        the same gradients)."""
        if self._stepped:
            raise OptionError(
                "LossScaler.step(optimizer) was called twice in one step: call scaler.update() after each "
                "scaler.step(optimizer)"
            )
        found_inf = self.unscale_(optimizer)
        self._stepped = True
        if found_inf:
            for holder in gradient_holders(optimizer):
                holder.grad = None
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` good steps; start the next step."""
        if self._found_inf is None:
            raise OptionError("LossScaler.update() before step(): call scaler.step(optimizer) first")
        if self._found_inf:
            self.scale_value = max(self.scale_value * self.backoff_factor, MIN_SCALE)
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale_value = min(self.scale_value * self.growth_factor, MAX_SCALE)
                self.good_steps = 0
        self._found_inf = None
        self._stepped = False

    def state_dict(self) -> dict[str, float | int]:
        """The scale and counters, to checkpoint with the rest of the training state."""
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Restore what :meth:`state_dict` returned; nothing changes unless all of it is valid.

        Args:
            state: ``{"scale": ..., "good_steps": ..., "skipped_steps": ...}``: a scale in
                [:data:`MIN_SCALE`, :data:`MAX_SCALE`] and two ints >= 0 (numpy numbers as the Python
                numbers they equal). Anything else (a missing or unknown key, a value of another type, a
                non-finite scale) is an :class:`~autopar.ir.errors.OptionError`.
        """
        check_keys(state, "LossScaler.load_state_dict(state)", _STATE_KEYS, required=_STATE_KEYS)
        scale = _check_scale(state["scale"], "LossScaler.load_state_dict(state): 'scale'")
        counts = [
            check_int(plain_number(state[k]), f"LossScaler.load_state_dict(state): {k!r}")
            for k in _STATE_KEYS[1:]
        ]
        self.scale_value = float(scale)
        self.good_steps, self.skipped_steps = counts


def _check_scale(value: object, what: str) -> float:
    """``value`` if it can scale a loss: a finite number in [:data:`MIN_SCALE`, :data:`MAX_SCALE`]."""
    number = check_number(plain_number(value), what)
    if number > MAX_SCALE:
        raise OptionError(
            f"{what} must be at most {MAX_SCALE:.4g} (float32's largest: a larger scale makes every fp32 "
            f"scaled loss inf, so every step would be skipped), got {value!r}"
        )
    if number < MIN_SCALE:
        raise OptionError(
            f"{what} must be at least {MIN_SCALE:.4g} (float32's smallest normal: a smaller scale makes "
            f"fp32 scaled losses 0 and their unscaling overflow), got {value!r}"
        )
    return number
