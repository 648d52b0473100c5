"""Scale: plan a Llama-2-7B-shaped model for mesh dp=8 x tp=8 on this machine.

transformers' ``LlamaForCausalLM`` is built from a config on the ``meta`` device
(32 layers, hidden 4096, 32 heads, FFN 11008, vocabulary 32000), with a batch of 8
sequences of 4096 tokens, and planned for the ``h100`` cluster model. Prints the
wall time with capture included, the capture / ILP build / solve split, and the
ILP's size. Target: at most 15 s wall on the 2-core development machine.
Run: ``python bench/plan_llama7b.py``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

import autopar

transformers.logging.set_verbosity_error()


def llama_2_7b(layers: int = 32, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' ``LlamaForCausalLM`` with Llama-2-7B's shape, on ``meta`` (no memory)."""
    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--cluster", default="h100")
    parser.add_argument("--mesh", default="dp=8,tp=8")
    a = parser.parse_args()
    mesh = {k: int(v) for k, v in (item.split("=") for item in a.mesh.split(","))}
    t0 = time.perf_counter()
    model = llama_2_7b(a.layers)
    ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (), mesh, example_kwargs={"input_ids": ids, "labels": ids}, cluster=a.cluster)
    wall = time.perf_counter() - t0
    s, p = plan.solver, plan.prediction
    result = {
        "wall_s": round(wall, 2),
        "capture_s": round(s.capture_s, 2),
        "build_s": round(s.build_s, 2),
        "solve_s": round(s.solve_s, 2),
        "ilp_variables": s.variables,
        "ilp_constraints": s.constraints,
        "choices": s.roots,
        "tied_blocks": s.tied_blocks,
        "gap": s.gap,
        "status": s.status,
        "predicted_step_s": round(p.step_time_s, 4),
        "predicted_comm_GiB": round(p.comm_bytes / 2**30, 2),
        "memory_GiB": round(p.memory_bytes / 2**30, 2),
        "warnings": plan.warnings,
    }
    print(json.dumps(result, indent=1))
    weights = {
        k: v for k, v in plan.parameters.items() if k.startswith("model.layers.0.") and "norm" not in k
    }
    print(json.dumps(weights, indent=1))


if __name__ == "__main__":
    main()
