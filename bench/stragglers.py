"""Update modes against a straggler: the example GPT on 4 gloo workers (+1 server), one slowed 3x.

``python bench/stragglers.py`` (from the repository's root, ``PYTHONPATH=.``) measures samples/s of
synchronous all-reduce, the parameter server, bounded and unbounded asynchronous updates and the
hybrid (2 groups of 2) while worker 3 sleeps after every step twice a synchronous step with no
straggler (timed once, before the modes: the same delay in every mode), so that its step takes 3x
the others', beside what :mod:`autopar.planning.cost.update_cost` predicts; ``--batch`` sets the
global batch (256: 64 samples per worker). ``--convergence`` trains a learnable task (each
sequence counts up from a random start: the next token is the previous plus one) for the same
number of samples under sync and async with staleness 1 and 2, with the same straggler, and plots
the loss curves (``--plot``). Results: ``docs/update_modes.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# the repository's root, for `examples` and `bench` when this runs as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.planning.cost.update_cost import predict_update  # noqa: E402
from autopar.tools.launch import spawn  # noqa: E402
from examples import gpt  # noqa: E402

WORKERS, SLOW = 4, 3
CONFIG = dict(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256)
MODES = {
    "sync": None,
    "parameter server": autopar.ParameterServer(),
    "async, staleness 1": autopar.Async(staleness=1),
    "async, staleness 2": autopar.Async(staleness=2),
    "async, unbounded": autopar.Async(staleness=None),
    "hybrid 2x2, staleness 1": autopar.Hybrid(groups=2, staleness=1),
    "hybrid 2x2, unbounded": autopar.Hybrid(groups=2, staleness=None),
}


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (``size`` sequences) of the counting task, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CONFIG["vocab_size"], (size, 1), generator=g)
    seq = (start + torch.arange(CONFIG["seq_len"] + 1)) % CONFIG["vocab_size"]
    return seq[:, :-1], seq[:, 1:]


def _compiled(mode: str, size: int) -> tuple[object, object]:
    torch.manual_seed(0)
    model, (idx, _) = gpt.build(batch_size=size, **CONFIG)
    update = MODES[mode]
    if update is None:
        mesh = init_device_mesh("cpu", (WORKERS,), mesh_dim_names=("dp",))
        return autopar.compile(model, mesh, (idx,)), mesh
    mesh = autopar.worker_mesh(update, {"dp": WORKERS})
    return autopar.compile(model, mesh, (idx,), update=update), mesh


def run(mode: str, steps: int, seconds: float, lr: float, size: int, delay: float) -> dict:
    """One rank's part: ``steps`` steps of global batch ``size`` (sync, or every unit under an
    update mode), or as many as fit in ``seconds`` when it is above 0; worker :data:`SLOW` sleeps
    ``delay`` seconds after each step."""
    dmodel, mesh = _compiled(mode, size)
    if dmodel.is_server if hasattr(dmodel, "is_server") else False:
        dmodel.serve()
        return {}
    optimizer = dmodel.optimizer(torch.optim.AdamW, lr=lr, foreach=True)
    losses, done = [], 0
    delay = delay if dist.get_rank() == SLOW else 0.0
    # ranks that meet at collectives every step stop together: all of sync's, a hybrid unit's
    together = mesh.get_group("dp") if mode == "sync" else None
    if getattr(dmodel, "unit_size", 1) > 1:
        together = dmodel.unit_mesh.get_group("dp")
    dist.barrier(group=mesh.get_group("dp"))
    t0 = time.perf_counter()
    clock = getattr(dmodel, "clock", 0)
    while done < steps if seconds <= 0 else True:
        x, y = batch(clock + done, size)
        losses.append(dmodel.train_step((x,), y, gpt.loss_fn).item())
        time.sleep(delay)
        optimizer.step()
        optimizer.zero_grad()
        done += 1
        if seconds > 0:
            stop = torch.tensor([float(time.perf_counter() - t0 >= seconds)])
            if together is not None:
                dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=together)
            if stop.item():
                break
    elapsed = time.perf_counter() - t0
    if hasattr(dmodel, "close"):
        dmodel.close()
    share = size // WORKERS  # each rank's replica's share of a step's batch
    return {
        "steps": done,
        "elapsed": elapsed,
        "samples": done * share,
        "losses": losses,
        "log": getattr(dmodel, "log", []),
    }


def predicted(cluster: str, size: int) -> dict[str, float]:
    """Samples/s :func:`predict_update` gives each mode on ``cluster`` (a preset, or a file from
    ``autopar calibrate --ranks 5``: the workers and the server sharing this machine)."""
    torch.manual_seed(0)
    model, (idx, _) = gpt.build(batch_size=size, device="meta", **CONFIG)
    plan = autopar.plan(model, (idx,), {"dp": WORKERS}, cluster=cluster)
    slow = [1.0] * WORKERS
    # the straggler's step 3x a synchronous one, as the measured delay makes it: its own work
    # stretched by twice the whole step
    work = plan.prediction.compute_s + plan.prediction.overhead_s
    slow[SLOW] = 1 + 2 * plan.step_time_s / work
    rates = {m: predict_update(plan, u, slow, size).samples_per_s for m, u in MODES.items()}
    return {"no straggler": size / plan.step_time_s, **rates}


def straggler_delay(size: int, seconds: float) -> tuple[float, float]:
    """``(delay, samples/s)``: the straggler's sleep per step, twice a synchronous step with no
    straggler (timed for ``seconds``, as every rank runs it, sharing the host's cores), so that
    its step takes 3x the others' and sync runs at a third of its pace; the same delay in every
    mode. (A delay from its forward and backward alone, timed apart, leaves out the optimizer,
    the gradient sums and the cores it shares: sync slowed by about 2x, not 3x, here.)"""
    worker = spawn(run, WORKERS, "sync", 0, seconds, 1e-3, size, 0.0)[0]
    return 2 * worker["elapsed"] / worker["steps"], worker["samples"] * WORKERS / worker["elapsed"]


def _print_row(row: dict) -> None:
    print(
        f"{row['mode']:<26} measured {row['measured']:7.1f} samples/s, "
        f"predicted {row['predicted']:7.1f}; staleness <= {row.get('max_staleness', 0)}"
    )


def stragglers(seconds: float, cluster: str, size: int) -> list[dict]:
    expect = predicted(cluster, size)
    delay, alone = straggler_delay(size, seconds)
    print(f"global batch {size}; the straggler sleeps {delay * 1e3:.1f} ms a step")
    rows = [{"mode": "sync, no straggler", "measured": alone, "predicted": expect.pop("no straggler")}]
    _print_row(rows[0])
    for mode in MODES:
        ranks = spawn(run, WORKERS + (0 if MODES[mode] is None else 1), mode, 0, seconds, 1e-3, size, delay)
        workers = [r for r in ranks if r]
        rate = sum(r["samples"] for r in workers) / max(r["elapsed"] for r in workers)
        if mode == "sync":
            rate = workers[0]["samples"] * WORKERS / workers[0]["elapsed"]
        stale = max((entry[2] for r in workers for entry in r["log"]), default=0)
        rows.append({"mode": mode, "measured": rate, "predicted": expect[mode], "max_staleness": stale})
        _print_row(rows[-1])
    return rows


def convergence(steps: int, plot: str | None, size: int) -> dict[str, list[float]]:
    curves, delay = {}, straggler_delay(size, 5.0)[0]
    for mode in ("sync", "async, staleness 1", "async, staleness 2"):
        ranks = [r for r in spawn(run, WORKERS + (mode != "sync"), mode, steps, 0.0, 3e-3, size, delay) if r]
        curves[mode] = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(steps)]
        tail = sum(curves[mode][-5:]) / 5
        print(f"{mode:<20} loss over the last 5 steps {tail:.4f}")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode, curve in curves.items():
            ax.plot([(i + 1) * size for i in range(steps)], curve, label=mode)
        ax.set(
            xlabel="samples",
            ylabel="training loss",
            yscale="log",
            title="GPT, counting task, 4 workers, one 3x slower",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
    return curves


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="timed training per mode")
    parser.add_argument("--convergence", type=int, default=0, help="steps of the convergence run (0: none)")
    parser.add_argument("--plot", help="write the convergence curves here (.png)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--cluster", default="cpu-gloo", help="a preset or a file from autopar calibrate")
    parser.add_argument("--batch", type=int, default=256, help="global batch (a multiple of 4)")
    a = parser.parse_args()
    found = {
        "date": time.strftime("%Y-%m-%d"),
        "batch": a.batch,
        "convergence": convergence(a.convergence, a.plot, a.batch) if a.convergence else {},
    }
    found["stragglers"] = stragglers(a.seconds, a.cluster, a.batch) if a.seconds > 0 else []
    if a.json:
        with open(a.json, "w") as f:
            json.dump(found, f, indent=1)
