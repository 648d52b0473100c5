"""Megatron check: does the solver, with no annotations, find Megatron's plan for a GPT block?

A one-block GPT (the example model) on mesh dp=2 x tp=4 is planned twice on the
``h100`` cluster model, once as one 8-GPU node and once as two 4-GPU nodes (so that
``dp`` crosses nodes, as in Megatron deployments):

* **auto**: no annotations at all;
* **megatron**: the hand-written Megatron-LM weight splits as annotations (q, k, v and
  fc column-parallel over ``tp``, attention proj and mlp proj row-parallel), everything
  else completed by the solver.

It prints both plans' predicted step time and communication, and the layouts the
auto plan gave the MLP and attention weights. Run: ``python bench/megatron_check.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

# the repository's root, for `examples` and `bench` when this runs as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from examples import gpt  # noqa: E402

COLUMN = {"weight": ("tp", None), "bias": ("tp",)}
ROW = {"weight": (None, "tp")}


def megatron_weights(model: gpt.GPT) -> None:
    """Megatron-LM's weight splits; unlike ``gpt.annotate`` no activation is pinned."""
    for block in model.blocks:
        for linear in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):
            autopar.shard(linear, parameter_plan=COLUMN)
        for linear in (block.attn.proj, block.mlp.proj):
            autopar.shard(linear, parameter_plan=ROW)


def run(cluster: autopar.Cluster, batch: int, seq: int, d_model: int, heads: int) -> dict:
    """Plan auto and Megatron; their predictions and the auto plan's weight layouts."""
    mesh = {"dp": 2, "tp": 4}
    config = dict(n_layers=1, d_model=d_model, n_heads=heads, d_ff=4 * d_model, seq_len=seq, vocab_size=32000)
    results = {}
    for name in ("auto", "megatron"):
        model, args = gpt.build(device="meta", batch_size=batch, **config)
        if name == "megatron":
            megatron_weights(model)
        t0 = time.perf_counter()
        plan = autopar.plan(model, args, mesh, cluster=cluster)
        wall = time.perf_counter() - t0
        p = plan.prediction
        results[name] = {
            "step_ms": p.step_time_s * 1e3,
            "comm_ms": p.comm_s * 1e3,
            "comm_MiB": p.comm_bytes / 2**20,
            "plan_s": wall,
            "layouts": {
                k: v
                for k, v in plan.parameters.items()
                if k.startswith("blocks.0.") and k.endswith("weight") and "ln" not in k
            },
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="h100")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    a = parser.parse_args()
    base = autopar.get_cluster(a.cluster)
    for nodes, per_node in ((1, 8), (2, 4)):
        cluster = dataclasses.replace(base, devices_per_node=per_node)
        results = run(cluster, a.batch, a.seq, a.d_model, a.heads)
        print(f"== {nodes} node(s) of {per_node} devices ({a.cluster}) ==")
        print(json.dumps(results, indent=1))
        for name, r in results.items():
            print(f"{name}: step {r['step_ms']:.3f} ms, comm {r['comm_ms']:.3f} ms ({r['comm_MiB']:.1f} MiB)")


if __name__ == "__main__":
    main()
