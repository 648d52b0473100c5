"""Plan-only model zoo at real sizes: what autopar plans for well-known models on 64 GPUs.

Each model is built on the ``meta`` device at its published size (no memory), given a
training batch with labels, and planned for a 64-device mesh (``dp=8 x tp=8``) under the
``h100`` cluster model. Prints, per model, the wall time of planning (capture included),
the predicted step time and memory per device, how the batch input and the first
block's weights are laid out, and any op without a sharding rule; or, for a model no
plan fits, the planner's error with the least memory it reached.
Run: ``python bench/zoo_plans.py [names...]`` (all by default; a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import transformers

import autopar

transformers.logging.set_verbosity_error()
MESH = {"dp": 8, "tp": 8}


def tokens(batch: int, seq: int) -> dict:
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _images(batch: int, size: int) -> dict:
    return {
        "pixel_values": torch.zeros(batch, 3, size, size, device="meta"),
        "labels": torch.zeros(batch, dtype=torch.long, device="meta"),
    }


# Llama-3-8B's decoder shape; Mixtral-8x7B shares it and routes each token to 2 of 8 experts
DECODER_8B = dict(
    num_hidden_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    max_position_embeddings=8192,
)


def llama_3_8b() -> tuple:
    config = transformers.LlamaConfig(vocab_size=128256, **DECODER_8B)
    return transformers.LlamaForCausalLM(config), tokens(16, 4096)


def mixtral_8x7b() -> tuple:
    config = transformers.MixtralConfig(
        vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, **DECODER_8B
    )
    return transformers.MixtralForCausalLM(config), tokens(16, 4096)


def t5_large() -> tuple:
    config = transformers.T5Config(
        vocab_size=32128,
        d_model=1024,
        d_kv=64,
        d_ff=4096,
        num_layers=24,
        num_heads=16,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config), tokens(64, 512)


def bert_large() -> tuple:
    config = transformers.BertConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    )
    ids = torch.zeros(256, 512, dtype=torch.long, device="meta")
    return transformers.BertForMaskedLM(config), {"input_ids": ids, "labels": ids}


def vit_l_16() -> tuple:
    config = transformers.ViTConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        num_labels=1000,
    )
    return transformers.ViTForImageClassification(config), _images(512, 224)


def resnet_50() -> tuple:
    config = transformers.ResNetConfig(
        depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck", num_labels=1000
    )
    return transformers.ResNetForImageClassification(config), _images(1024, 224)


ZOO: dict[str, Callable[[], tuple]] = {
    "llama-3-8b": llama_3_8b,
    "mixtral-8x7b": mixtral_8x7b,
    "t5-large": t5_large,
    "bert-large": bert_large,
    "vit-l-16": vit_l_16,
    "resnet-50": resnet_50,
}


def plan_one(name: str, cluster: str) -> dict:
    """Build ``name`` on meta, plan it for :data:`MESH`, and summarise the plan."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        model, kwargs = ZOO[name]()
    plan = autopar.plan(model, (), MESH, example_kwargs=kwargs, cluster=cluster)
    wall = time.perf_counter() - t0
    first = sorted(k for k in plan.parameters if ".0." in k and k.endswith("weight"))[:6]
    return {
        "model": name,
        "parameters_B": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
        "plan_wall_s": round(wall, 1),
        "predicted_step_s": round(plan.prediction.step_time_s, 3),
        "memory_GiB": round(plan.prediction.memory_bytes / 2**30, 1),
        "inputs": dict(plan.inputs),
        "first_block": {k: plan.parameters[k] for k in first},
        "no_rule": [w for w in plan.warnings if "no sharding rule" in w],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(ZOO))
    parser.add_argument("--cluster", default="h100")
    a = parser.parse_args()
    for name in a.names:
        try:
            print(json.dumps(plan_one(name, a.cluster)), flush=True)
        except autopar.PlanError as exc:  # reported as a result: the model has no plan that fits
            print(json.dumps({"model": name, "no_plan": str(exc)}), flush=True)


if __name__ == "__main__":
    main()
