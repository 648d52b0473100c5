"""Megatron's layouts found by the solver, at real sizes (plan only, on ``meta``).

* ``gpt2``, ``phi-3-mini``, ``gpt-neox`` (transformers GPT-2 small, Phi-3-mini and a
  Pythia-1.4B-shaped GPT-NeoX, fused projections as their authors wrote them), 8 sequences
  with labels (2 of 4096 tokens for Phi-3), on ``tp=8`` and ``dp=2 x tp=4`` (``h100``): the
  solver's own plan (how it lays out the first block's projections, predicted step and
  memory) next to Megatron's plan
  given as annotations (q/k/v and gate/up split by heads as strided shards, the output and
  down projections by rows), planned the same way.
* ``llama-3-8b``: transformers ``LlamaForCausalLM`` at Llama-3-8B's shape (vocabulary 128256),
  16 sequences of 8192 tokens with labels, fp32, on ``dp=8 x tp=8`` under the ``h100`` model:
  planning time, predicted memory per device, how the embedding and the loss's lookup of
  the target logit are laid out, and every redistribution that gathers a vocabulary-sized
  activation whole onto a rank (Megatron-LM and torchtitan's ``loss_parallel`` have none).

Run: ``python bench/megatron_layouts.py [names...] [--mesh dp=8,tp=8]``; one JSON line per
model and mesh. Results in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import transformers
from zoo_plans import DECODER_8B, tokens  # this directory is on sys.path when run as a script

import autopar
from autopar.ir.layout import parse_layout

transformers.logging.set_verbosity_error()


def llama_3_8b() -> tuple:
    config = transformers.LlamaConfig(vocab_size=128256, **DECODER_8B)
    return transformers.LlamaForCausalLM(config), tokens(16, 8192), config.vocab_size


def gpt2() -> tuple:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    qkv = autopar.Parts("tp", 3)
    megatron = {  # Conv1D weights are (in, out)
        "attn": {"c_attn.weight": (None, qkv), "c_attn.bias": (qkv,), "c_proj.weight": ("tp", None)},
        "mlp": {"c_fc.weight": (None, "tp"), "c_fc.bias": ("tp",), "c_proj.weight": ("tp", None)},
    }
    return model, tokens(8, 1024), model.transformer.h, megatron


def phi_3_mini() -> tuple:
    config = transformers.Phi3Config(
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )
    model = transformers.Phi3ForCausalLM(config)
    megatron = {
        "self_attn": {"qkv_proj.weight": (autopar.Parts("tp", 3), None), "o_proj.weight": (None, "tp")},
        "mlp": {"gate_up_proj.weight": (autopar.Parts("tp", 2), None), "down_proj.weight": (None, "tp")},
    }
    return model, tokens(2, 4096), model.model.layers, megatron


def gpt_neox() -> tuple:
    config = transformers.GPTNeoXConfig(  # Pythia-1.4B's shape
        vocab_size=50304,
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=8192,
    )
    model = transformers.GPTNeoXForCausalLM(config)
    megatron = {
        "attention": {
            "query_key_value.weight": ("tp", None),
            "query_key_value.bias": ("tp",),
            "dense.weight": (None, "tp"),
        },
        "mlp": {
            "dense_h_to_4h.weight": ("tp", None),
            "dense_h_to_4h.bias": ("tp",),
            "dense_4h_to_h.weight": (None, "tp"),
        },
    }
    return model, tokens(8, 2048), model.gpt_neox.layers, megatron


HEADS: dict[str, Callable[[], tuple]] = {"gpt2": gpt2, "phi-3-mini": phi_3_mini, "gpt-neox": gpt_neox}
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


def _summary(plan: autopar.Plan, wall: float) -> dict:
    first = {
        k: v for k, v in plan.parameters.items() if ".0." in k and k.endswith("weight") and "norm" not in k
    }
    return {
        "plan_wall_s": round(wall, 1),
        "predicted_step_s": round(plan.prediction.step_time_s, 4),
        "memory_GiB": round(plan.prediction.memory_bytes / 2**30, 2),
        "first_block": first,
    }


def plan_heads(name: str, mesh: dict[str, int], cluster: str) -> dict:
    """The solver's plan and Megatron's (annotated) plan of one model with fused projections."""
    out = {"model": name, "mesh": mesh}
    for variant in ("solver", "megatron"):
        t0 = time.perf_counter()
        with torch.device("meta"):
            model, kwargs, blocks, megatron = HEADS[name]()
        if variant == "megatron":
            for block in blocks:
                for child, plan in megatron.items():
                    autopar.shard(getattr(block, child), parameter_plan=plan)
        try:
            plan = autopar.plan(model, (), mesh, example_kwargs=kwargs, cluster=cluster)
        except autopar.PlanError as exc:  # reported as a result: no plan of this kind fits
            out[variant] = {"no_plan": str(exc)}
            continue
        out[variant] = _summary(plan, time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=[*HEADS, *MODELS])
    parser.add_argument("--mesh", default=None, help="default: tp=8 and dp=2,tp=4 (dp=8,tp=8 for llama)")
    parser.add_argument("--cluster", default="h100")
    a = parser.parse_args()
    given = a.mesh and {k: int(v) for k, v in (item.split("=") for item in a.mesh.split(","))}
    for name in a.names:
        if name in HEADS:
            for mesh in [given] if given else [{"tp": 8}, {"dp": 2, "tp": 4}]:
                print(json.dumps(plan_heads(name, mesh, a.cluster)), flush=True)
        else:
            print(json.dumps(plan_one(name, given or {"dp": 8, "tp": 8}, a.cluster)), flush=True)


if __name__ == "__main__":
    main()
