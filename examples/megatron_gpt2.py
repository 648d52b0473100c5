"""Megatron's layouts on transformers' GPT-2, unchanged: heads, columns, rows and the vocabulary.

GPT-2 computes q, k and v in one fused ``Conv1D`` (``c_attn``), ties its embedding to its
LM head and takes the loss inside ``forward``. :func:`annotate` asks, MindSpore style, for
Megatron-LM's tensor parallelism over mesh axis ``tp``: ``c_attn`` split by heads
(``autopar.Parts("tp", 3)``: each rank holds its heads' piece of q, of k and of v), the
attention output and MLP down projections by rows, the MLP up projection by columns, and
the tied embedding by vocabulary. The loss then stays split by vocabulary too (the solver
picks vocab-parallel cross entropy: the logits are never whole on a rank).

Run under ``torchrun --nproc-per-node 4 examples/megatron_gpt2.py``: compiles for
``dp=2 x tp=2`` gloo ranks, trains a few SGD steps and prints the loss next to one device's.
Without ``torchrun`` it prints the plan (no ranks needed).
"""

from __future__ import annotations

import copy

import torch

import autopar


def build() -> tuple[torch.nn.Module, dict]:
    """A 2-layer GPT-2 (vocabulary 1000, 4 heads of 16) and a batch whose first tokens are not scored."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, key, 0.0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (4, 16))
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt: ignored by the loss
    return model, {"input_ids": ids, "labels": labels, "use_cache": False}


def annotate(model: torch.nn.Module) -> None:
    """Megatron-LM's tensor-parallel plan over mesh axis ``tp`` (Conv1D weights are (in, out))."""
    heads = autopar.Parts("tp", 3)
    for block in model.transformer.h:
        autopar.shard(
            block.attn,
            parameter_plan={
                "c_attn.weight": (None, heads),
                "c_attn.bias": (heads,),
                "c_proj.weight": ("tp", None),
            },
        )
        autopar.shard(block.mlp, parameter_plan={"c_fc.weight": (None, "tp"), "c_proj.weight": ("tp", None)})
    autopar.shard(model.lm_head, parameter_plan={"weight": ("tp", None)})  # tied: the embedding too


def main() -> None:
    """The demo (see the module docstring)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, batch = build()
    reference = copy.deepcopy(model)
    annotate(model)
    if "RANK" not in os.environ:
        print(
            autopar.plan(model, (), {"dp": 2, "tp": 2}, example_kwargs=batch, cluster="fast-links").summary()
        )
        return
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    dmodel = autopar.compile(model, mesh, (), example_kwargs=batch, cluster="fast-links")
    optimizer = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    local_args, local_kwargs = dmodel.shard_inputs(**batch)
    for step in range(3):
        loss = dmodel(*local_args, **local_kwargs).loss
        ref_loss = reference(**batch).loss
        for opt, value in ((optimizer, loss), (ref_optimizer, ref_loss)):
            value.backward()
            opt.step()
            opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.5f} (one device: {ref_loss.item():.5f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
