"""Scale: plan Llama shapes from 7B to 405B for up to 16,384 ranks on this machine.

transformers' ``LlamaForCausalLM`` is built from a config on the ``meta`` device (no memory)
and planned for the ``h100`` cluster model. Each case prints the wall time with capture
included, the capture / build / solve split, the ILP's size, the predicted step and the
memory of the rank holding the most (the largest pipeline stage's, under a pipeline).

Cases (``--case``):

- ``llama-2-7b``: 32 layers, hidden 4096, 32 heads, FFN 11008, vocabulary 32000, fp32,
  batch 8 x sequence 4096, dp=8 x tp=8. Target: 15 s.
- ``llama-3-8b``: 32 layers, hidden 4096, 32 / 8 kv heads, FFN 14336, vocabulary 128256,
  bf16, batch 16 x sequence 8192, dp=8 x tp=8. Target: 10 s, memory search included.
- ``llama-3-70b``: 80 layers, hidden 8192, 64 / 8 kv heads, FFN 28672, bf16, batch 128 x
  sequence 8192, pp=8 x dp=8 x tp=8, 1F1B with 16 microbatches.
- ``llama-3.1-405b``: 126 layers, hidden 16384, 128 / 8 kv heads, FFN 53248, bf16, batch
  2048 x sequence 8192, pp=16 x dp=128 x tp=8 = 16,384 ranks, 1F1B with 16 microbatches.
  Target: 60 s.

``--code reference`` plans the same shapes written as Llama's reference code rather than as
transformers writes it (``examples/handwritten.py``: rotary embeddings as complex numbers, the
rotary table a buffer every layer reads, the loss outside the model).

Run: ``python bench/plan_scale.py --case llama-3-8b`` (``--layers`` for fewer layers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import autopar

transformers.logging.set_verbosity_error()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for --code reference

# layers, hidden, heads, kv heads, FFN, vocabulary, dtype
SHAPES: dict[str, tuple[int, int, int, int, int, int, torch.dtype]] = {
    "llama-2-7b": (32, 4096, 32, 32, 11008, 32000, torch.float32),
    "llama-3-8b": (32, 4096, 32, 8, 14336, 128256, torch.bfloat16),
    "llama-3-70b": (80, 8192, 64, 8, 28672, 128256, torch.bfloat16),
    "llama-3.1-405b": (126, 16384, 128, 8, 53248, 128256, torch.bfloat16),
}
# batch, sequence, mesh, microbatches (None: no pipeline)
CASES: dict[str, tuple[int, int, dict[str, int], int | None]] = {
    "llama-2-7b": (8, 4096, {"dp": 8, "tp": 8}, None),
    "llama-3-8b": (16, 8192, {"dp": 8, "tp": 8}, None),
    "llama-3-70b": (128, 8192, {"pp": 8, "dp": 8, "tp": 8}, 16),
    "llama-3.1-405b": (2048, 8192, {"pp": 16, "dp": 128, "tp": 8}, 16),
}


def llama(shape: str, layers: int | None = None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """transformers' ``LlamaForCausalLM`` of ``shape`` (a key of :data:`SHAPES`), on ``meta``."""
    n, hidden, heads, kv_heads, ffn, vocab, built = SHAPES[shape]
    config = transformers.LlamaConfig(
        num_hidden_layers=layers or n,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=8192,
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(dtype or built)


def reference_llama(
    shape: str, layers: int | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """The reference-style Llama of ``examples/handwritten.py`` at ``shape``, with its loss, on ``meta``."""
    from examples.handwritten import LlamaArgs, LlamaWithLoss

    n, hidden, heads, kv_heads, ffn, vocab, built = SHAPES[shape]
    # its FFN is 8/3 of the hidden size rounded up to a multiple: rounded up to the shape's FFN
    args = LlamaArgs(
        dim=hidden,
        n_layers=layers or n,
        n_heads=heads,
        n_kv_heads=kv_heads,
        vocab_size=vocab,
        multiple_of=ffn,
        rope_theta=500000.0,
        max_seq_len=8192,
    )
    with torch.device("meta"):
        return LlamaWithLoss(args).to(dtype or built)


# the hand meshes of 64 devices the automatic mesh must match or beat (issue 16), 1F1B with 8 microbatches
HAND_64: list[dict[str, int]] = [
    {"dp": 64},
    {"dp": 8, "tp": 8},
    {"dp": 16, "tp": 4},
    {"dp": 32, "tp": 2},
    {"pp": 2, "dp": 4, "tp": 8},
    {"pp": 4, "dp": 2, "tp": 8},
]


def run_case(
    case: str,
    layers: int | None = None,
    dtype: torch.dtype | None = None,
    mesh: dict[str, int] | int | None = None,
    code: str = "transformers",
    **options: Any,
) -> dict[str, Any]:
    """Plan ``case`` (a key of :data:`CASES`; the shape's dtype unless ``dtype``, the case's mesh
    unless ``mesh``: a device count searches it) written as ``code`` (``"transformers"`` or
    ``"reference"``); its figures as a dict. ``options`` go to ``autopar.plan``."""
    batch, seq, case_mesh, microbatches = CASES[case]
    mesh = case_mesh if mesh is None else mesh
    if isinstance(mesh, dict) and "pp" in mesh and microbatches is None:
        microbatches = 8
    t0 = time.perf_counter()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    if code == "reference":
        model, args, kwargs = reference_llama(case, layers, dtype), (ids, ids), {}
    else:
        model, args, kwargs = llama(case, layers, dtype), (), {"input_ids": ids, "labels": ids}
    if microbatches is not None and isinstance(mesh, dict) and "pp" in mesh:
        options.setdefault("pipeline", autopar.Pipeline(microbatches, "1f1b"))
    plan = autopar.plan(model, args, mesh, example_kwargs=kwargs, cluster="h100", **options)
    wall = time.perf_counter() - t0
    s, pp = plan.solver, plan.pipeline
    return {
        "case": case,
        "mesh": str(plan.device_mesh_spec),
        "pipeline": None if pp is None else f"{pp.schedule} m={pp.microbatches}",
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
        "memory_plan": None if plan.memory is None else f"ZeRO-{plan.memory.zero}",
        "predicted_step_s": round(plan.step_time_s, 4),
        "peak_memory_GiB": round(plan.peak_memory_bytes / 2**30, 2),
        "warnings": plan.warnings,
        "mesh_candidates": plan.mesh_candidates,
        "layer_0": {
            k: v for k, v in plan.parameters.items() if k.startswith("model.layers.0.") and "norm" not in k
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="llama-2-7b")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="instead of the shape's")
    parser.add_argument("--devices", type=int, help="search the mesh for this many devices")
    parser.add_argument("--hand", action="store_true", help="plan the hand meshes of 64 devices too")
    parser.add_argument("--code", choices=("transformers", "reference"), default="transformers")
    a = parser.parse_args()
    dtype = None if a.dtype is None else getattr(torch, a.dtype)
    print(json.dumps(run_case(a.case, a.layers, dtype, a.devices, a.code), indent=1))
    for mesh in HAND_64 if a.hand else []:
        row = run_case(a.case, a.layers, dtype, mesh, a.code)
        keys = ("mesh", "pipeline", "wall_s", "predicted_step_s", "peak_memory_GiB")
        print(json.dumps({k: row[k] for k in keys}))


if __name__ == "__main__":
    main()
