"""Predicted scaling over device counts (``autopar scaling``): one plan per count, of the example
batch (strong scaling) and of the batch grown with the devices (weak scaling), and their plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autopar.ir.options import MixedPrecision


def scaling_table(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    devices: Sequence[int],
    axis: str,
    cluster: Any,
    precision: MixedPrecision | None = None,
) -> list[dict[str, float]]:
    """Per device count (the first is 1): the predicted step of the example batch (strong
    scaling) and of the batch grown with the devices (weak scaling), planned on ``{axis: n}``.

    Args:
        model: the model planned.
        args: its positional example inputs (the batch, dim 0, grows for weak scaling).
        kwargs: its keyword example inputs.
        devices: the device counts, 1 first.
        axis: the name of the one mesh axis the devices form.
        cluster: the cluster planned for.
        precision: the mixed precision planned with, if any.
    """
    import autopar

    rows = []
    for n in devices:
        options = {"cluster": cluster, "precision": precision}
        strong = autopar.plan(model, args, {axis: n}, example_kwargs=kwargs, **options)
        grown_args, grown_kwargs = torch.utils._pytree.tree_map(lambda t, n=n: _grown(t, n), (args, kwargs))
        weak = autopar.plan(model, grown_args, {axis: n}, example_kwargs=grown_kwargs, **options)
        step, grown = strong.prediction.step_time_s, weak.prediction.step_time_s
        rows.append({"devices": n, "step_s": step, "grown_step_s": grown})
    t1 = rows[0]["step_s"]
    for r in rows:
        r["speedup"] = t1 / r["step_s"]
        r["efficiency"] = r["speedup"] / r["devices"]
        r["scaled_speedup"] = r["devices"] * t1 / r["grown_step_s"]
    return rows


def _grown(t: Any, n: int) -> Any:
    """``t`` with ``n`` times its batch (dim 0), for weak scaling."""
    return t.repeat(n, *([1] * (t.dim() - 1))) if isinstance(t, torch.Tensor) and t.dim() else t


def plot_scaling(
    rows: Sequence[dict[str, float]], amdahl: tuple, gustafson: tuple, title: str, path: str
) -> None:
    """Speedups against device counts (the ticks), each law's fit labelled with how well it fits.

    Args:
        rows: :func:`scaling_table`'s rows.
        amdahl: Amdahl's serial fraction, its speedup per row and how far off it is at worst.
        gustafson: Gustafson's, likewise (scaled speedups).
        title: what was planned, for the title.
        path: the image file written (``.png``, ``.svg``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    n = [r["devices"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
    ax.plot(n, n, "k:", label="ideal")
    ax.plot(n, [r["speedup"] for r in rows], "o-", label="fixed batch (predicted)")
    ax.plot(n, amdahl[1], "--", label=f"Amdahl, s={amdahl[0]:.3f} (off by up to {amdahl[2]:.0%})")
    ax.plot(n, [r["scaled_speedup"] for r in rows], "s-", label="grown batch (predicted)")
    ax.plot(n, gustafson[1], "--", label=f"Gustafson, s={gustafson[0]:.3f} (off by up to {gustafson[2]:.0%})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(n, [str(k) for k in n])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.set_xlabel("devices")
    ax.set_ylabel("speedup")
    ax.set_title(f"predicted speedup: {title}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
