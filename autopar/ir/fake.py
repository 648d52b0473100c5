"""Fake tensors: the one adapter onto torch's private ``torch._subclasses.fake_tensor``.

Under a fake mode ops compute shapes, dtypes and strides and allocate nothing: the memory model
runs each op that saves tensors on fake operands of a rank's pieces, and the lowering runs the
whole per-rank program so once before any step. torch exports the class only from a private
module; ``tests/test_local_programs.py`` fails loudly if it moves or changes its meaning.

Everything else in autopar makes fake tensors through this module.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode


def fake_mode() -> FakeTensorMode:
    """A mode in which tensors made or computed are fake (no memory); real tensors may enter it."""
    return FakeTensorMode(allow_non_fake_inputs=True)
