"""Megatron's layouts found by the solver, at real sizes (plan only, on ``meta``).

* ``llama-3-8b``: transformers ``LlamaForCausalLM`` at Llama-3-8B's shape (vocabulary 128256),
  16 sequences of 8192 tokens with labels, fp32, on ``dp=8 x tp=8`` under the ``h100`` model:
  planning time, predicted memory per device, how the embedding and the loss's lookup of
  the target logit are laid out, and every redistribution that gathers a vocabulary-sized
  activation whole onto a rank (Megatron-LM and torchtitan's ``loss_parallel`` have none).

Run: ``python bench/megatron_layouts.py [names...] [--mesh dp=8,tp=8]``; one JSON line per
model. Results in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import transformers

import autopar
from autopar.ir.layout import parse_layout

transformers.logging.set_verbosity_error()


def llama_3_8b() -> tuple:
    config = transformers.LlamaConfig(
        vocab_size=128256,
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        max_position_embeddings=8192,
    )
    ids = torch.zeros(16, 8192, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    return transformers.LlamaForCausalLM(config), batch, config.vocab_size


MODELS: dict[str, Callable[[], tuple]] = {"llama-3-8b": llama_3_8b}


def _vocab_gathers(plan: autopar.Plan, vocab: int) -> list[str]:
    """Redistributions that leave a vocabulary-sized activation with its vocabulary dim whole."""
    stored = {n.name for n in plan.nodes if n.kind in ("param", "zero3")}
    found = []
    for r in plan.redistributions:
        if vocab not in r.shape or not r.forward or r.src in stored:
            continue
        dim = r.shape.index(vocab)
        need = parse_layout(r.need)
        if not any(getattr(p, "dim", None) == dim for p in need):
            found.append(f"{r.src}->{r.dst} {r.shape} {r.have}->{r.need}")
    return found


def plan_one(name: str, mesh: dict[str, int], cluster: str) -> dict:
    t0 = time.perf_counter()
    with torch.device("meta"):
        model, kwargs, vocab = MODELS[name]()
    plan = autopar.plan(model, (), mesh, example_kwargs=kwargs, cluster=cluster)
    wall = time.perf_counter() - t0
    looked_up = ("aten.embedding.default", "aten.gather.default")
    ops = {n.op.split(".")[1]: n.operands[0] for n in plan.nodes if n.op in looked_up}
    return {
        "model": name,
        "mesh": mesh,
        "plan_wall_s": round(wall, 1),
        "predicted_step_s": round(plan.prediction.step_time_s, 3),
        "memory_GiB": round(plan.prediction.memory_bytes / 2**30, 1),
        "activations_GiB": round(plan.prediction.activation_bytes / 2**30, 1),
        "memory_plan": {"zero": plan.memory.zero, "recompute": len(plan.memory.recompute)},
        "embedding_weight": plan.parameters.get("model.embed_tokens.weight"),
        "lm_head_weight": plan.parameters.get("lm_head.weight"),
        "lookups": ops,
        "vocab_sized_gathers": _vocab_gathers(plan, vocab),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(MODELS))
    parser.add_argument("--mesh", default="dp=8,tp=8")
    parser.add_argument("--cluster", default="h100")
    a = parser.parse_args()
    mesh = {k: int(v) for k, v in (item.split("=") for item in a.mesh.split(","))}
    for name in a.names:
        print(json.dumps(plan_one(name, mesh, a.cluster)), flush=True)


if __name__ == "__main__":
    main()
