"""A multilayer perceptron: Linear layers with GELU between them, trained on an MSE loss.

:func:`build` returns a model and example inputs; the defaults (:data:`TINY`) are small enough for unit
tests, and bigger models come from keyword overrides, e.g.
``build(d_hidden=8192, n_layers=16, batch_size=64, device="meta")`` to plan one without allocating it.

Run as a script, this builds the default model and prints its parameter count.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of an :class:`MLP`; ``n_layers`` counts Linear layers and must be at least 1."""

    d_in: int
    d_hidden: int
    d_out: int
    n_layers: int


TINY = MLPConfig(d_in=16, d_hidden=64, d_out=8, n_layers=3)


class MLP(nn.Module):
    """``n_layers`` Linear layers ``layers.0 ... layers.{n_layers - 1}`` with GELU after each but the last.

    The first layer maps ``d_in -> d_hidden``, the middle ones ``d_hidden -> d_hidden`` and the last one
    ``d_hidden -> d_out``; with ``n_layers == 1`` the single layer maps ``d_in -> d_out`` and ``d_hidden``
    is unused.
    """

    def __init__(self, d_in: int, d_hidden: int, d_out: int, n_layers: int) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"MLP needs n_layers >= 1, got {n_layers}")
        widths = [d_in, *[d_hidden] * (n_layers - 1), d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Map ``x`` of shape ``(..., d_in)`` to ``(..., d_out)``.

        With ``target`` (the output's shape) the scalar mean squared error against it is returned instead.
        """
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        out = self.layers[-1](x)
        if target is None:
            return out
        return F.mse_loss(out, target)


def build(
    config: MLPConfig = TINY,
    *,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    **overrides: int,
) -> tuple[MLP, tuple[torch.Tensor, torch.Tensor]]:
    """Build an :class:`MLP` and example ``(x, target)`` inputs of ``batch_size`` rows.

    ``overrides`` replace fields of ``config`` (``build(n_layers=8)``). Parameters and inputs are created
    directly on ``device``; on ``"meta"`` nothing is allocated, which is how large models are planned.
    Weights and inputs come from torch's global RNG: seed it for reproducible values.
    """
    cfg = dataclasses.replace(config, **overrides)
    with torch.device(device):
        model = MLP(cfg.d_in, cfg.d_hidden, cfg.d_out, cfg.n_layers)
        x = torch.randn(batch_size, cfg.d_in)
        target = torch.randn(batch_size, cfg.d_out)
    return model, (x, target)


def main() -> None:
    """Build the default model and print its parameter count."""
    model, _ = build()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MLP {TINY}: {n_params:,} parameters")


if __name__ == "__main__":
    main()
