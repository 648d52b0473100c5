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

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.ir.errors import OptionError
from autopar.runtime.optimizer import gradient_holders


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
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise OptionError(
                f"LossScaler needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1, got "
                f"{init_scale}, {growth_factor} and {backoff_factor}"
            )
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise OptionError(
                f"LossScaler(growth_interval=...) must be a positive int, got {growth_interval!r}"
            )
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0
        self._found_inf: bool | None = None  # this step's verdict, once unscaled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale, for ``.backward()``."""
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide this step's gradients by the scale, in place; whether any rank found inf or NaN.

        Once per step: a second call returns the first verdict without dividing again.
        """
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
        on every rank when any rank overflowed; whether it stepped."""
        if self.unscale_(optimizer):
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
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.good_steps = 0
        self._found_inf = None

    def state_dict(self) -> dict[str, float | int]:
        """The scale and counters, to checkpoint with the rest of the training state."""
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.scale_value = float(state["scale"])
        self.good_steps, self.skipped_steps = int(state["good_steps"]), int(state["skipped_steps"])
