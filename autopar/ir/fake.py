"""Fake tensors: the one adapter onto torch's private ``torch._subclasses.fake_tensor``.

Under a fake mode ops compute shapes, dtypes and strides and allocate nothing: the memory model
runs each op that saves tensors on fake operands of a rank's pieces, and the lowering runs the
whole per-rank program so once before any step. torch exports the class only from a private
module; ``tests/test_local_programs.py`` fails loudly if it moves or changes its meaning.

Everything else in autopar makes fake tensors through this module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


def fake_mode() -> FakeTensorMode:
    """A mode in which tensors made or computed are fake (no memory); real tensors may enter it."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(value: object) -> bool:
    """Whether ``value`` is a fake tensor (it has a device, but no values)."""
    return isinstance(value, FakeTensor)


def fake_on(examples: Any, device: str | torch.device) -> Any:
    """``examples`` (a pytree) with each ``meta`` tensor made a fake tensor of its shape, dtype and
    ``requires_grad`` on ``device``: a program traced on them may mix in real tensors of that device
    (a loss's class weights) and still allocates nothing."""
    mode = fake_mode()

    def on_device(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_meta:
            return value
        with mode:
            made = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return made.requires_grad_(value.requires_grad)

    return pytree.tree_map(on_device, examples)
