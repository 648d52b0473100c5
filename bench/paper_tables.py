"""Megatron-LM's published runs (Narayanan et al., SC'21, Table 1 and Fig. 13) planned by autopar.

Each row is the example GPT at the paper's shape (vocabulary 51200, sequence 2048, d_ff = 4h),
built on ``meta``, bf16 :class:`autopar.MixedPrecision`, ``recompute(block, "full-comm")`` on every
block (Megatron's full recompute: only the block's input kept, its collectives run again), on the
``a100`` preset, planned three ways:

* **megatron**: the paper's mesh ``pp x dp x tp``, schedule, microbatches and virtual stages, with
  Megatron's layouts given as annotations (q, k, v and fc column-parallel, the projections
  row-parallel, the embedding and the output layer split by vocabulary, the residual stream split
  by batch over ``dp``, blocks staged evenly, no ZeRO, its microbatches accumulated where it has
  no pipeline);
* **solver**: the same mesh, pipeline and stages, no layout annotation: the solver's own plan;
* **auto** (``--auto``): the device count alone (the automatic mesh).

Each prints the predicted iteration beside the paper's (``F / (GPUs x TFLOP/s)``, with
``F = 96 B s l h^2 (1 + s/6h + V/16lh)``), the memory per rank and the planning time, one JSON
line per row and way. Run: ``python bench/paper_tables.py [rows...] [--ways megatron,solver]
[--fig13]``; rows are named by their parameter count (``1.7B``). Results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# the repository's root, for `examples` when this runs as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from examples import gpt  # noqa: E402

VOCAB, SEQ = 51200, 2048


@dataclass(frozen=True)
class Run:
    """One published run: the model's shape, the mesh and schedule, and the measured rate."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    microbatch: int
    virtual_stages: int
    tflops_per_gpu: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Microbatches each dp rank runs per iteration (pipelined or accumulated)."""
        return self.batch // (self.dp * self.microbatch)

    @property
    def flops(self) -> float:
        """The paper's FLOPs per iteration (full recompute: four forward passes' worth)."""
        b, s, h, n = self.batch, SEQ, self.hidden, self.layers
        return 96 * b * s * n * h**2 * (1 + s / (6 * h) + VOCAB / (16 * n * h))

    @property
    def measured_s(self) -> float | None:
        """The iteration the paper measured, derived from its TFLOP/s per GPU (None where it gives none:
        Fig. 13's runs)."""
        return self.flops / (self.gpus * self.tflops_per_gpu * 1e12) if self.tflops_per_gpu else None


TABLE_1 = (
    Run("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    Run("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    Run("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    Run("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    Run("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    Run("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    Run("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    Run("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    Run("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    Run("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
)


def fig_13() -> list[Run]:
    """Fig. 13: a 162.2B GPT on 64 GPUs, (pipeline, tensor) from (2, 32) to (32, 2); rate unknown (0)."""
    sizes = (2, 4, 8, 16, 32)
    return [Run(f"162.2B p{p} t{64 // p}", 128, 20480, 32, 64 // p, p, 64, 128, 1, 1, 0) for p in sizes]


def build(run: Run) -> tuple[gpt.GPT, tuple[torch.Tensor, torch.Tensor]]:
    """The example GPT at ``run``'s shape on meta, every block recomputed as Megatron's full recompute."""
    model, args = gpt.build(
        device="meta",
        batch_size=run.batch,
        vocab_size=VOCAB,
        seq_len=SEQ,
        d_model=run.hidden,
        n_heads=run.heads,
        n_layers=run.layers,
        d_ff=4 * run.hidden,
        fused_attention=False,  # Megatron-LM of 2021 materialised the attention scores (no flash attention)
    )
    for block in model.blocks:
        autopar.recompute(block, "full-comm")
    return model, args


def stage_evenly(model: gpt.GPT, stages: int) -> None:
    """Megatron's stages: ``layers / stages`` blocks each, the embeddings first, the head last."""
    per = len(model.blocks) // stages
    if per * stages != len(model.blocks):
        raise ValueError(f"{len(model.blocks)} blocks do not split into {stages} equal stages")
    for i, block in enumerate(model.blocks):
        autopar.pipeline_stage(block, i // per)
    for module in (model.wte, model.wpe):
        autopar.pipeline_stage(module, 0)
    for module in (model.ln_f, model.lm_head):
        autopar.pipeline_stage(module, stages - 1)


def megatron_layouts(model: gpt.GPT) -> None:
    """Megatron-LM's tensor and data parallel layouts as annotations (no sequence parallelism)."""
    column = {"weight": ("tp", None), "bias": ("tp",)}
    row = {"weight": (None, "tp")}
    stream = (("dp", None, None),)
    for block in model.blocks:
        for linear in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):
            autopar.shard(linear, parameter_plan=column)
        for linear in (block.attn.proj, block.mlp.proj):
            autopar.shard(linear, parameter_plan=row)
        autopar.shard(block, in_strategy=stream, out_strategy=stream)
    autopar.shard(model.wte, parameter_plan={"weight": ("tp", None)})
    autopar.shard(model.lm_head, parameter_plan={"weight": ("tp", None)})


def mesh_of(run: Run) -> dict[str, int]:
    """The paper's mesh, pipeline axis first where there is a pipeline (``tp`` of size 1 kept, so
    that the annotations name it)."""
    return ({"pp": run.pp} if run.pp > 1 else {}) | {"dp": run.dp, "tp": run.tp}


def plan_row(run: Run, way: str, cluster: str, time_limit: float) -> dict:
    """Plan ``run`` one ``way`` (megatron, solver or auto); its predictions beside the paper's."""
    model, args = build(run)
    pipeline = None
    if run.pp > 1:
        schedule = "interleaved-1f1b" if run.virtual_stages > 1 else "1f1b"
        pipeline = autopar.Pipeline(run.microbatches, schedule, virtual_stages=run.virtual_stages)
    if way in ("megatron", "solver") and run.pp > 1:
        stage_evenly(model, run.pp * run.virtual_stages)
    memory, accumulation = None, None
    if way == "megatron":
        megatron_layouts(model)
        memory = autopar.Memory(zero=0)
        if run.pp == 1:  # Megatron accumulates its microbatches without a pipeline
            accumulation = run.microbatches
    mesh: int | dict[str, int] = run.gpus if way == "auto" else mesh_of(run)
    t0 = time.perf_counter()
    paper = run.measured_s
    out: dict = {"row": run.name, "way": way, "mesh": mesh, "paper_s": paper and round(paper, 2)}
    try:
        plan = autopar.plan(
            model,
            args,
            mesh,
            cluster=cluster,
            pipeline=pipeline if way != "auto" else None,
            memory=memory,
            precision=autopar.MixedPrecision(),
            time_limit=time_limit,
            accumulation=accumulation,
        )
    except autopar.AutoparError as exc:
        out.update(error=str(exc)[:400], plan_s=round(time.perf_counter() - t0, 1))
        return out
    step = plan.prediction.step_time_s  # a whole step, the pipeline's schedule included
    out.update(
        plan_s=round(time.perf_counter() - t0, 1),
        predicted_s=round(step, 2),
        paper_over_predicted=paper and round(paper / step, 3),
        memory_GiB=round(plan.peak_memory_bytes / 2**30, 1),
        zero=plan.memory.zero if plan.memory else None,
        recompute=len(plan.memory.recompute) if plan.memory else None,
        accumulation=plan.accumulation,
    )
    if way == "auto":
        out["chosen_mesh"] = plan.mesh | ({plan.pipeline.axis: plan.pipeline.size} if plan.pipeline else {})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", help="rows by parameter count (default: all)")
    parser.add_argument("--ways", default="megatron,solver", help="megatron, solver, auto")
    parser.add_argument("--cluster", default="a100")
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--fig13", action="store_true", help="Fig. 13's (pipeline, tensor) sweep instead")
    a = parser.parse_args()
    runs = fig_13() if a.fig13 else [r for r in TABLE_1 if not a.rows or r.name in a.rows]
    for run in runs:
        for way in a.ways.split(","):
            print(json.dumps(plan_row(run, way, a.cluster, a.time_limit)), flush=True)


if __name__ == "__main__":
    main()
