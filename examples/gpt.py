"""A GPT-2-style decoder-only transformer trained on next-token cross-entropy.

Module names follow GPT-2 (``wte``, ``wpe``, ``blocks.{i}.attn.q``, ``blocks.{i}.mlp.fc``, ``ln_f``,
``lm_head``) because annotations and plans refer to parameters by these paths. Queries, keys and
values have separate projections (as in Llama): a fused ``qkv`` weight cannot be split by heads with
a plain DTensor ``Shard``, so separate projections are what head-parallel attention needs.

:func:`build` returns a model and example inputs; the defaults (:data:`TINY`) are small enough for unit
tests, and bigger models come from a preset or keyword overrides, e.g.
``build(GPT2_SMALL, batch_size=8, device="meta")`` to plan GPT-2 small (124M) without allocating it.

Run under ``torchrun --nproc-per-node 4``, the script compiles and trains it on a 2 x 2 mesh of gloo
ranks (see :func:`main`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`.

    ``seq_len`` is the longest sequence the position embedding covers; ``d_model`` must be divisible by
    ``n_heads``. With ``tied_embeddings`` the output projection shares its weight with the token embedding.
    Without ``fused_attention`` attention computes its scores, the causal mask and the softmax as
    separate ops (as nanoGPT without flash attention, and Megatron-LM before it): the scores are
    materialised, ``seq_len`` squared per head.
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    dropout: float = 0.0
    tied_embeddings: bool = False
    fused_attention: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


TINY = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2, d_ff=256)
GPT2_SMALL = GPTConfig(
    vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072, tied_embeddings=True
)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``q``, ``k``, ``v`` projections, then ``proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.fused = config.fused_attention
        self.q = nn.Linear(config.d_model, config.d_model)
        self.k = nn.Linear(config.d_model, config.d_model)
        self.v = nn.Linear(config.d_model, config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(batch, seq, d_model)``, each position only to itself and earlier."""
        batch, seq, d_model = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        # (batch, seq, d_model) -> (batch, heads, seq, head_dim): SDPA attends over the last two dims.
        head_dim = d_model // self.n_heads
        # -1 heads, not n_heads: under tensor parallelism each rank holds only some of them
        q = q.view(batch, seq, -1, head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, head_dim).transpose(1, 2)
        if self.fused:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            weights = F.dropout(F.softmax(scores, dim=-1), self.dropout, self.training)
            y = weights @ v
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The feed-forward half of a block: ``fc`` (d_model -> d_ff), GELU, ``proj`` (d_ff -> d_model)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        # GPT-2 uses the tanh approximation of GELU.
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(config.d_ff, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward network position-wise; the output has ``x``'s shape."""
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transform ``x`` of shape ``(batch, seq, d_model)``; the output has the same shape."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks in ``blocks``, then ``ln_f`` and ``lm_head``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Map token ids ``idx`` of shape ``(batch, seq)`` to logits ``(batch, seq, vocab_size)``.

        ``seq`` may not exceed ``seq_len`` (ValueError). With ``targets`` (token ids of ``idx``'s shape)
        the scalar mean cross-entropy of the logits against them is returned instead.
        """
        seq = idx.size(1)
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of length {seq} is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights and zero biases; LayerNorms keep torch's (1, 0)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build(
    config: GPTConfig = TINY,
    *,
    batch_size: int = 2,
    device: torch.device | str = "cpu",
    **overrides: int | float | bool,
) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """Build a :class:`GPT` and example ``(idx, targets)`` token ids of shape ``(batch_size, seq_len)``.

    ``overrides`` replace fields of ``config`` (``build(n_layers=4)``, ``build(GPT2_SMALL, n_layers=2)``).
    Parameters and inputs are created directly on ``device``; on ``"meta"`` nothing is allocated, which is
    how large models are planned. Weights and inputs come from torch's global RNG: seed it for
    reproducible values.
    """
    cfg = dataclasses.replace(config, **overrides)
    with torch.device(device):
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
        targets = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
    return model, (idx, targets)


STYLES = ("dp", "tp", "sp", "dp-tp")


def annotate(model: GPT, style: str) -> GPT:
    """Hand-written parallel plans for this model, as autopar annotations; returns ``model``.

    ``"dp"``: data parallel over ``dp`` (every parameter replicated, the batch split).
    ``"tp"``: Megatron-LM tensor parallelism over ``tp``: ``q``, ``k``, ``v`` and ``mlp.fc``
    split by output features (column-parallel), ``attn.proj`` and ``mlp.proj`` by input
    features (row-parallel), the activations between blocks whole on every rank.
    ``"sp"``: ``"tp"`` with Megatron sequence parallelism: the residual stream between and
    inside blocks split along the sequence over ``tp``, so the row-parallel outputs are
    reduce-scattered and the norms run on sequence shards. ``"dp-tp"``: ``"tp"`` with the
    batch split over ``dp``. Anything left open is the solver's to fill.
    """
    import autopar

    if style not in STYLES:
        raise ValueError(f"unknown plan style {style!r}; styles are {STYLES}")
    if style == "dp":
        for module in model.modules():
            direct = dict(module.named_parameters(recurse=False))
            if direct:
                autopar.shard(module, parameter_plan={n: (None,) * p.dim() for n, p in direct.items()})
    else:
        column = {"weight": ("tp", None), "bias": ("tp",)}
        row = {"weight": (None, "tp")}
        sequence = ((None, "tp", None),)
        # the residual stream: split along the sequence (sp), or whole on the tp axis
        stream = {"sp": sequence, "tp": ((None, None, None),), "dp-tp": (("dp", None, None),)}[style]
        for block in model.blocks:
            for linear in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):
                autopar.shard(linear, parameter_plan=column)
            for linear in (block.attn.proj, block.mlp.proj):
                autopar.shard(linear, parameter_plan=row, out_strategy=sequence if style == "sp" else None)
            autopar.shard(block, in_strategy=stream, out_strategy=stream)
    if style in ("dp", "dp-tp"):
        autopar.shard(model, in_strategy=(("dp", None), ("dp", None)))
    return model


DEMO = GPTConfig(vocab_size=4096, seq_len=128, d_model=256, n_heads=4, n_layers=4, d_ff=1024)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``logits`` ``(batch, seq, vocab)`` against ``targets`` ``(batch, seq)``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def demo(batch_size: int = 16) -> tuple[GPT, tuple[torch.Tensor]]:
    """The demo model and the example input :func:`main` compiles it with (a factory for
    ``autopar plan examples/gpt.py:demo``: a plan saved from it trains with ``--plan``)."""
    torch.manual_seed(0)
    model, (idx, _) = build(DEMO, batch_size=batch_size)
    return model, (idx,)


def _say_where_predictions_come_from(cluster: str | None, mesh: int | dict[str, int]) -> None:
    """Under a preset (``cluster`` None is ``cpu-gloo``), print that its figures are not this host's
    and how to measure them for the ranks of ``mesh`` (a device count or axis sizes); nothing for a
    cluster file (``autopar calibrate``'s)."""
    preset = cluster or "cpu-gloo"
    if not preset.endswith(".json"):
        ranks = mesh if isinstance(mesh, int) else math.prod(mesh.values())
        print(
            f"predictions use the {preset} preset, not this host's figures, so measured steps differ: "
            f"run `autopar calibrate --ranks {ranks} -o cluster.json` and pass --cluster cluster.json"
        )


def main() -> None:
    """The demo: compile and train the GPT on every rank of a ``torchrun`` job.

    ``torchrun --nproc-per-node 4 examples/gpt.py`` trains :data:`DEMO` on a 2 x 2
    mesh ("dp", "tp") of gloo ranks and prints the plan and the losses. A mesh with a
    ``pp`` axis first pipelines the model (``--mesh pp=2,dp=2 --schedule 1f1b
    --microbatches 4``); a device count (``--mesh 4``) lets the planner choose the mesh and
    pipeline too (``docs/automatic_mesh.md``). ``--cluster`` prices the plan with a preset or
    with the file ``autopar calibrate`` wrote for this machine. Run without ``torchrun``, it
    prints the parameter count and the plan only (no ranks needed).
    """
    import argparse
    import os

    import autopar
    from autopar.tools.telemetry import StepMeter

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument(
        "--mesh", default="dp=2,tp=2", help="e.g. dp=4, dp=2,tp=2, pp=2,dp=2, or 4: the planner chooses"
    )
    parser.add_argument("--cluster", help="a preset (cpu-gloo, h100, ...) or a file from `autopar calibrate`")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4, help="with a pp axis: microbatches per step")
    parser.add_argument("--schedule", default="1f1b", choices=autopar.ir.options.SCHEDULES)
    parser.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (interleaved-1f1b)")
    parser.add_argument("--tiny", action="store_true", help="the small test model instead of the demo one")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default: the planner's)")
    parser.add_argument("--recompute", choices=("full", "selective"), help="recompute every block")
    parser.add_argument("--offload-optimizer", action="store_true", help="optimizer state on the host")
    parser.add_argument("--offload-activations", action="store_true", help="saved activations on the host")
    parser.add_argument("--memory-budget", type=float, help="bytes per device the plan must fit")
    parser.add_argument("--plan", help="a plan saved by `autopar plan ... -o plan.json` (for this model)")
    parser.add_argument(
        "--precision", choices=("bf16", "fp16"), help="compute in it, fp32 master weights (MixedPrecision)"
    )
    parser.add_argument("--telemetry", help="also write each step's measurements here as JSON lines")
    a = parser.parse_args()
    memory = autopar.Memory(
        zero=a.zero, offload_optimizer=a.offload_optimizer, offload_activations=a.offload_activations
    )
    precision = None
    if a.precision:
        precision = autopar.MixedPrecision({"bf16": torch.bfloat16, "fp16": torch.float16}[a.precision])
    planning = dict(pipeline=None, memory=memory, memory_budget=a.memory_budget, precision=precision)
    if a.cluster:
        planning["cluster"] = a.cluster
    devices = int(a.mesh) if a.mesh.isdigit() else None  # the planner searches the mesh
    axes = [] if devices else [item.split("=") for item in a.mesh.split(",")]
    mesh_sizes = {name: int(size) for name, size in axes}
    if "pp" in mesh_sizes:
        planning["pipeline"] = autopar.Pipeline(a.microbatches, a.schedule, a.virtual_stages)
    config = TINY if a.tiny else DEMO
    torch.manual_seed(0)
    model, (idx, _) = build(config, batch_size=a.batch_size)
    if a.recompute:
        for block in model.blocks:
            autopar.recompute(block, a.recompute)
    n_params = sum(p.numel() for p in model.parameters())
    if os.environ.get("RANK", "0") == "0":
        print(f"GPT {config}: {n_params:,} parameters")
        _say_where_predictions_come_from(a.cluster, devices or mesh_sizes)
    if "RANK" not in os.environ:
        print(autopar.plan(model, (idx,), devices or mesh_sizes, **planning).summary())
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    mesh = devices or init_device_mesh("cpu", tuple(mesh_sizes.values()), mesh_dim_names=tuple(mesh_sizes))
    if a.plan:  # a saved plan brings its pipeline and memory plan
        dmodel = autopar.compile(model, mesh, (idx,), plan=autopar.load_plan(a.plan))
    else:
        dmodel = autopar.compile(model, mesh, (idx,), **planning)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(dmodel.plan.summary())
    optimizer = dmodel.optimizer(torch.optim.AdamW, lr=2e-3)  # over ZeRO's pieces, or host copies
    # one fixed batch (the same on every rank) to memorise: the loss must fall fast
    idx = torch.randint(0, config.vocab_size, idx.shape, generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, dims=1)
    # each step's time, tokens/s, MFU, bytes moved and memory beside the plan's prediction
    meter = StepMeter(dmodel, optimizer, tokens=idx.numel(), jsonl=a.telemetry)
    scaler = autopar.LossScaler() if a.precision == "fp16" else None  # fp16 gradients underflow unscaled
    for step in range(a.steps):
        with meter.step():
            # forward and backward; the loss on every rank
            loss = dmodel.train_step((idx,), targets, loss_fn, loss_scaler=scaler)
            if scaler is None:
                optimizer.step()
            else:  # skipped, on every rank, when a gradient overflowed
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
        if rank0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
