"""Training step time of the example GPT on 4 gloo ranks, one row per parallel variant.

Usage, from the repository root::

    python bench/train_speed.py [--steps 20] [--warmup 3] [--variants ddp-dp4,tp-tp4] [--json out.json]
    torchrun --nproc-per-node 4 bench/train_speed.py [same options]

Run plainly, the script spawns its 4 ranks itself (gloo on 127.0.0.1, one thread each, since
the ranks share the host's cores); under ``torchrun`` it joins the group torchrun set up.

A *variant* is a function ``(model, mesh, batch) -> step_fn`` registered in :data:`VARIANTS`
with the mesh it runs on. It gets a freshly built model (same seeded weights on every rank) and
the whole global batch, parallelizes them however it likes, and returns ``step_fn``: one full
training step (forward, backward, ``AdamW`` step) that returns the loss as a float. The mean of
that float over all ranks must be the loss of the global batch: a rank may return the loss of
its own equal-sized share of the batch (data parallel) or of the whole batch (tensor parallel).

Each variant is timed over ``--steps`` steps after ``--warmup`` untimed ones. Before every step
all ranks meet at a barrier; a step's time is the slowest rank's, and the table gives the median
and mean over steps. Every variant's losses of the first two steps are checked against plain
single-process training of the same model on the same batch (computed once, on rank 0); a
mismatch marks the row and makes the script exit with status 1, since a variant that computes a
different step is not worth timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

# Run as a plain script from a checkout (and in spawned ranks, which re-import this file): make the
# repository importable for ``examples``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.tools.launch import free_port  # noqa: E402
from examples import gpt  # noqa: E402

WORLD_SIZE = 4
SEED = 0
LR = 1e-3
# Steps whose losses are checked against the single-process reference: the first catches a
# wrong forward, the second wrong gradients (e.g. a missing gradient all-reduce).
CHECKED_STEPS = 2
# The variants' fp32 losses differ from the reference by ~1e-7 relative (reduction order); a
# data-parallel step without the gradient all-reduce moved the second loss by 3% on a tiny model.
LOSS_RTOL = 1e-4

# 5.3M parameters, 2.1M of them in wte and lm_head (4096 x 256). On the 2-core host a step took
# 0.4 s (ddp-dp4) to 1.1 s (tp-tp4, where every rank runs the replicated lm_head on the whole batch).
DEFAULT_CONFIG = gpt.GPTConfig(vocab_size=4096, seq_len=128, d_model=256, n_heads=4, n_layers=4, d_ff=1024)
DEFAULT_BATCH = 16

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[], float]


@dataclass(frozen=True)
class Variant:
    """A way to train: the mesh it runs on (axis name -> size, in order) and its step builder."""

    mesh: dict[str, int]
    make_step: Callable[[nn.Module, DeviceMesh, Batch], StepFn]
    baseline: str | None = None  # the torch-native variant this one is compared with

    def mesh_label(self) -> str:
        """The mesh as the table shows it, e.g. ``dp=2 x tp=2``."""
        return " x ".join(f"{name}={size}" for name, size in self.mesh.items())


def training_step(model: nn.Module, params: Iterable[nn.Parameter], batch: Batch) -> StepFn:
    """One AdamW training step of ``model`` on ``batch``, the same for every variant."""
    # fused: one kernel per parameter group instead of per-op dispatch, which costs DTensor
    # parameters (tensor parallelism, autopar) far more than plain ones; the fused kernel
    # takes DTensors or plain tensors, not both, hence a group of each
    params = list(params)
    groups = [
        {"params": g}
        for g in (
            [p for p in params if isinstance(p, DTensor)],
            [p for p in params if not isinstance(p, DTensor)],
        )
        if g
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, fused=True)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _require_divisible(what: str, value: int, axis: str, size: int) -> None:
    """Raise a ValueError naming the option to change if ``value`` does not split over ``axis``."""
    if value % size:
        raise ValueError(f"{what}={value} does not split over {axis}={size}")


def _batch_share(batch: Batch, mesh: DeviceMesh) -> Batch:
    """This rank's contiguous share of the global batch, split over the 1-D data-parallel ``mesh``."""
    idx, targets = batch
    n, rank = mesh.size(), mesh.get_local_rank()
    _require_divisible("batch size", idx.size(0), mesh.mesh_dim_names[0], n)
    share = slice(rank * idx.size(0) // n, (rank + 1) * idx.size(0) // n)
    return idx[share], targets[share]


def _tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Megatron-style TP over the 1-D ``mesh``: q, k, v and mlp.fc by columns, the two projections by
    rows; embeddings, norms and lm_head stay replicated."""
    cfg = model.config
    axis = mesh.mesh_dim_names[0]
    # Whole heads per rank, or attention would mix heads across the shard boundary.
    _require_divisible("n_heads", cfg.n_heads, axis, mesh.size())
    _require_divisible("d_ff", cfg.d_ff, axis, mesh.size())
    plan = {}
    for i in range(cfg.n_layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def ddp_step(model: nn.Module, mesh: DeviceMesh, batch: Batch) -> StepFn:
    """DistributedDataParallel over the 1-D mesh, each rank training on its share of the batch."""
    ddp = DistributedDataParallel(model, device_mesh=mesh)
    return training_step(ddp, ddp.parameters(), _batch_share(batch, mesh))


def tp_step(model: nn.Module, mesh: DeviceMesh, batch: Batch) -> StepFn:
    """Tensor parallelism over the 1-D mesh; every rank runs the whole batch."""
    _tensor_parallel(model, mesh)
    return training_step(model, model.parameters(), batch)


def ddp_tp_step(model: nn.Module, mesh: DeviceMesh, batch: Batch) -> StepFn:
    """TP over ``tp``, then DDP over ``dp``.

    DDP's ``device_mesh=`` argument with a submesh is what makes this work: given DTensor
    parameters, DDP then swaps them for their local shards (and rebuilds the DTensors around each
    forward), so its buckets all-reduce plain local gradients over ``dp``. With
    ``process_group=`` instead, DDP's initial parameter broadcast fails on the DTensors in
    torch 2.13.
    """
    _tensor_parallel(model, mesh["tp"])
    ddp = DistributedDataParallel(model, device_mesh=mesh["dp"])
    return training_step(ddp, ddp.parameters(), _batch_share(batch, mesh["dp"]))


def autopar_step(style: str | None) -> Callable[[nn.Module, DeviceMesh, Batch], StepFn]:
    """autopar with a hand-written plan (``gpt.annotate`` style) or, with ``style=None``, the solver's."""

    def make_step(model: nn.Module, mesh: DeviceMesh, batch: Batch) -> StepFn:
        if style is not None:
            gpt.annotate(model, style)
        dmodel = autopar.compile(model, mesh, batch)
        local_batch, _ = dmodel.shard_inputs(*batch)
        return training_step(dmodel, dmodel.parameters(), local_batch)

    return make_step


VARIANTS: dict[str, Variant] = {
    "ddp-dp4": Variant({"dp": 4}, ddp_step),
    "autopar-dp4": Variant({"dp": 4}, autopar_step("dp"), "ddp-dp4"),
    "autopar-auto-dp4": Variant({"dp": 4}, autopar_step(None), "ddp-dp4"),
    "tp-tp4": Variant({"tp": 4}, tp_step),
    "autopar-tp4": Variant({"tp": 4}, autopar_step("tp"), "tp-tp4"),
    "autopar-auto-tp4": Variant({"tp": 4}, autopar_step(None), "tp-tp4"),
    "ddp-tp-2x2": Variant({"dp": 2, "tp": 2}, ddp_tp_step),
    "autopar-2x2": Variant({"dp": 2, "tp": 2}, autopar_step("dp-tp"), "ddp-tp-2x2"),
    "autopar-auto-2x2": Variant({"dp": 2, "tp": 2}, autopar_step(None), "ddp-tp-2x2"),
}


@dataclass(frozen=True)
class Options:
    """What one run measures; the same on every rank."""

    config: gpt.GPTConfig
    batch_size: int
    steps: int
    warmup: int
    variants: tuple[str, ...]
    json_path: Path | None


def _fresh(options: Options) -> tuple[gpt.GPT, Batch]:
    """The model and global batch every variant starts from: same seed, so same values on every rank."""
    torch.manual_seed(SEED)
    return gpt.build(options.config, batch_size=options.batch_size)


def _reference_losses(options: Options, n_steps: int) -> list[float]:
    """Losses of the first ``n_steps`` of plain single-process training, computed on rank 0 only
    (which then has a core to itself) and broadcast."""
    losses = torch.zeros(n_steps, dtype=torch.float64)
    if dist.get_rank() == 0:
        model, batch = _fresh(options)
        step = training_step(model, model.parameters(), batch)
        losses = torch.tensor([step() for _ in range(n_steps)], dtype=torch.float64)
    dist.broadcast(losses, src=0)
    return losses.tolist()


def _measure(names: tuple[str, ...], options: Options) -> dict[str, dict]:
    """Build every variant, then time them round-robin: one step of each per round.

    Interleaving makes the machine's drift (other load, thermal, page cache) hit every variant
    alike, so the ratio of two variants measured in the same rounds is far steadier than that
    of two separate runs. Returns, per variant, the timed steps' times (slowest rank's) and the
    losses of every step, warmup included, each the mean over ranks.
    """
    steps = {}
    for name in names:
        variant = VARIANTS[name]
        mesh = init_device_mesh("cpu", tuple(variant.mesh.values()), mesh_dim_names=tuple(variant.mesh))
        model, batch = _fresh(options)
        steps[name] = variant.make_step(model, mesh, batch)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(options.warmup + options.steps):
        for name in names:
            # Start together, so one rank's wait for a slower one from the previous step is not counted.
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(steps[name]())
            seconds[name].append(time.perf_counter() - start)
    results = {}
    for name in names:
        seconds_t = torch.tensor(seconds[name][options.warmup :], dtype=torch.float64)
        dist.all_reduce(seconds_t, op=dist.ReduceOp.MAX)
        losses_t = torch.tensor(losses[name], dtype=torch.float64)
        dist.all_reduce(losses_t)
        step_ms = (seconds_t * 1e3).tolist()
        median_ms = statistics.median(step_ms)
        results[name] = {
            "mesh": VARIANTS[name].mesh,
            "step_ms": step_ms,
            "median_ms": median_ms,
            "mean_ms": statistics.fmean(step_ms),
            "tokens_per_s": options.batch_size * options.config.seq_len / (median_ms / 1e3),
            "losses": (losses_t / dist.get_world_size()).tolist(),
        }
    for name, r in results.items():
        baseline = VARIANTS[name].baseline
        if baseline in results:
            # per round, so both steps of a ratio saw the same machine
            ratios = [a / b for a, b in zip(r["step_ms"], results[baseline]["step_ms"])]
            r["vs_baseline"] = statistics.median(ratios)
    return results


def _print_table(results: dict[str, dict], reference: list[float]) -> None:
    """The results table, on rank 0; ``!`` marks a loss that differs from the reference."""
    loss_columns = [f"loss@{i + 1}" for i in range(len(reference))]
    header = f"{'variant':<18}{'mesh':<14}{'median ms':>10}{'mean ms':>10}{'tokens/s':>11}{'vs native':>11}"
    print(header + "".join(f"{c:>11}" for c in loss_columns))
    for name, r in results.items():
        mesh = VARIANTS[name].mesh_label()
        ratio = f"{r['vs_baseline']:.3f}x" if "vs_baseline" in r else ""
        row = f"{name:<18}{mesh:<14}{r['median_ms']:>10.1f}{r['mean_ms']:>10.1f}"
        row += f"{r['tokens_per_s']:>11,.0f}{ratio:>11}"
        for got, want in zip(r["losses"], reference):
            mark = " " if math.isclose(got, want, rel_tol=LOSS_RTOL) else "!"
            row += f"{got:>10.5f}{mark}"
        print(row)
    print(f"{'reference':<18}{'1 process':<14}{'':>42}" + "".join(f"{x:>10.5f} " for x in reference))


def run_rank(options: Options) -> bool:
    """Measure every selected variant in the joined process group; rank 0 prints (and writes) the results.

    Returns True if every variant's losses match the reference (the same answer on every rank).
    """
    # The host's cores are shared by all ranks; more threads per rank would only oversubscribe them.
    torch.set_num_threads(1)
    rank = dist.get_rank()
    load_before = os.getloadavg()
    reference = _reference_losses(options, min(CHECKED_STEPS, options.warmup + options.steps))
    results = _measure(options.variants, options)
    load_after = os.getloadavg()
    ok = all(
        math.isclose(got, want, rel_tol=LOSS_RTOL)
        for r in results.values()
        for got, want in zip(r["losses"], reference)
    )
    if rank == 0:
        cfg = options.config
        n_params = sum(p.numel() for p in gpt.build(cfg, device="meta")[0].parameters())
        print(f"GPT {cfg}: {n_params / 1e6:.2f}M parameters, global batch {options.batch_size}")
        print(
            f"{WORLD_SIZE} gloo ranks, 1 thread each; {options.warmup} warmup + {options.steps} timed steps;"
            f" load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
        )
        _print_table(results, reference)
        if not ok:
            print(f"error: losses marked ! differ from the reference by more than {LOSS_RTOL:g} relative")
        if options.json_path:
            report = {
                "config": dataclasses.asdict(cfg),
                "n_params": n_params,
                "batch_size": options.batch_size,
                "world_size": WORLD_SIZE,
                "threads_per_rank": 1,
                "warmup": options.warmup,
                "steps": options.steps,
                "torch": torch.__version__,
                "load_average_before": load_before,
                "load_average_after": load_after,
                "reference_losses": reference,
                "losses_match": ok,
                "variants": results,
            }
            options.json_path.write_text(json.dumps(report, indent=2) + "\n")
    return ok


def _join_and_run(options: Options, **init: object) -> None:
    """Join the gloo group (``init`` goes to ``init_process_group``), run this rank, leave the group.

    Exits with status 1 on rank 0 if a loss differed. Only rank 0 does so: a launcher stops the other
    ranks as soon as one fails, and rank 0 may still be printing the table then.
    """
    dist.init_process_group("gloo", **init)
    rank = dist.get_rank()
    try:
        ok = run_rank(options)
    finally:
        dist.destroy_process_group()
    if not ok and rank == 0:
        sys.exit(1)


def _spawned_rank(rank: int, port: int, options: Options) -> None:
    """Entry point of a rank started by :func:`main`."""
    _join_and_run(options, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)


# The GPTConfig fields that get a command-line option: its integer sizes.
_SIZE_FIELDS = tuple(
    f.name for f in dataclasses.fields(gpt.GPTConfig) if type(getattr(DEFAULT_CONFIG, f.name)) is int
)


def _parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all)",
    )
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="global batch size")
    for name in _SIZE_FIELDS:
        default = getattr(DEFAULT_CONFIG, name)
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=default, help=f"model size (default {default})")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)

    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    sizes = {name: getattr(args, name) for name in _SIZE_FIELDS}
    return Options(
        # dropout is already 0 in the default; set anyway, since dropout makes losses unrepeatable
        config=dataclasses.replace(DEFAULT_CONFIG, dropout=0.0, **sizes),
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        variants=variants,
        json_path=args.json,
    )


def main(argv: list[str] | None = None) -> None:
    """Parse options, then run the ranks: joined from torchrun's environment, or spawned here."""
    options = _parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != WORLD_SIZE:
            sys.exit(f"the variants' meshes need {WORLD_SIZE} ranks: torchrun --nproc-per-node {WORLD_SIZE}")
        _join_and_run(options)
        return
    if os.getloadavg()[0] > 0.5:
        # Other work on the cores shows up as slower steps.
        print(f"warning: load average {os.getloadavg()[0]:.2f}; the host should be idle", file=sys.stderr)
    try:
        mp.spawn(_spawned_rank, args=(free_port(), options), nprocs=WORLD_SIZE)
    except mp.ProcessExitedException as exc:
        # A loss mismatch (rank 0 has reported it) or a rank killed by a signal; spawn re-raises a
        # Python exception in a rank as ProcessRaisedException instead, traceback included.
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
