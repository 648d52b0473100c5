"""Hand-written LLM code in the styles most often copied, written here from scratch.

Two codebases are copied by more research code than any other: a minimal GPT in one file
(a fused ``c_attn`` projection split into q, k and v, the attention output through
``transpose(1, 2).contiguous().view(...)``, the loss computed inside ``forward`` when targets
are given) and a reference Llama (rotary embeddings as complex numbers through
``torch.polar``, ``view_as_complex`` and ``view_as_real``; the rotary table a non-persistent
buffer every layer reads; grouped-query attention repeating keys and values by ``expand``;
the layers in an ``nn.ModuleDict``). These models follow those styles, so that autopar meets
the view and complex ops such code records; nothing here is copied from either codebase.

:data:`HANDWRITTEN` builds each as ``(model, args, kwargs)``, as ``tests/zoo_models.py`` does
(its zoo trains them on 4 gloo ranks against one device). Run as a script under
``torchrun --nproc-per-node 4 examples/handwritten.py``, it compiles the reference Llama on a
``dp=2 x tp=2`` mesh with its attention split by heads over ``tp`` and trains it for a few
steps; without ``torchrun`` it prints that plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import autopar

BATCH, SEQ, VOCAB = 4, 8, 128


@dataclass
class MiniGPTConfig:
    """Sizes of a :class:`MiniGPT`; ``n_embd`` need not be a multiple of any mesh axis's size."""

    vocab_size: int = VOCAB
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True


class FusedSelfAttention(nn.Module):
    """Causal attention with one fused projection for q, k and v."""

    def __init__(self, config: MiniGPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class FeedForward(nn.Module):
    def __init__(self, config: MiniGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, config: MiniGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = FusedSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MiniGPT(nn.Module):
    """A GPT in the one-file style: ``forward(idx, targets=None)`` returns ``(logits, loss)``."""

    def __init__(self, config: MiniGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as the style ties them
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


@dataclass
class LlamaArgs:
    """Sizes of a :class:`ReferenceLlama`; ``n_kv_heads`` below ``n_heads`` is grouped-query attention."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = VOCAB
    multiple_of: int = 32
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32


def rotary_table(dim: int, end: int, theta: float) -> torch.Tensor:
    """Unit complex numbers ``exp(i * t * theta^(-2j/dim))`` for positions ``t < end``."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def rotate(xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key pairs by the table's complex numbers (``(batch, seq, heads, head_dim)``)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    table = table.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * table).flatten(3)
    xk_out = torch.view_as_real(xk_ * table).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Each key/value head repeated ``n_rep`` times along the heads dim (dim 2)."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class GQAttention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1 heads: under tensor parallelism a rank holds some of them
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = rotate(xq, xk, table)
        keys, values = repeat_heads(xk, self.n_rep), repeat_heads(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous()
        return self.wo(output.view(bs, seqlen, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, multiplier: float | None) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if multiplier is not None:
            hidden_dim = int(multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention = GQAttention(args)
        self.feed_forward = SwiGLU(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class ReferenceLlama(nn.Module):
    """A Llama in the reference style: ``forward(tokens)`` returns logits; the loss is the caller's."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        table = rotary_table(args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta)
        self.register_buffer("freqs_cis", table, persistent=False)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.trunc_normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        table = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, table)
        return self.output(self.norm(h)).float()


class LlamaWithLoss(nn.Module):
    """The reference Llama and the training loop's cross entropy, as one module to compile."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.model = ReferenceLlama(args)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def _mini_gpt(heads_over: str | None = None) -> tuple:
    """A MiniGPT; with ``heads_over`` its attention split by heads over that mesh axis, as
    Megatron splits it (the fused projection's q, k and v parts each split, the output row-wise)."""
    model = MiniGPT(MiniGPTConfig())
    for block in model.transformer.h if heads_over else ():
        qkv = autopar.Parts(heads_over, 3)
        plan = {"c_attn.weight": (qkv, None), "c_attn.bias": (qkv,), "c_proj.weight": (None, heads_over)}
        autopar.shard(block.attn, parameter_plan=plan)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (ids, ids), {}


def _reference_llama(heads_over: str | None = None) -> tuple:
    """A LlamaWithLoss; with ``heads_over`` its attention split by heads over that mesh axis."""
    model = LlamaWithLoss(LlamaArgs())
    for layer in model.model.layers.values() if heads_over else ():
        columns = {f"{w}.weight": (heads_over, None) for w in ("wq", "wk", "wv")}
        autopar.shard(layer.attention, parameter_plan={**columns, "wo.weight": (None, heads_over)})
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (ids, ids), {}


def _mini_gpt_five_heads() -> tuple:
    """A MiniGPT of 5 heads given one long sequence: split by heads over 4 ranks, as DTensor splits
    5 rows, the ranks hold 2, 2, 1 and no heads (GPT-2 XL's 25 heads over 8: 4, 4, 4, 4, 4, 4, 1, 0)."""
    model = MiniGPT(MiniGPTConfig(n_head=5, n_embd=80, block_size=512))
    ids = torch.randint(0, VOCAB, (1, 512))
    return model, (ids, ids), {}


#: The hand-written models, each as the solver plans it and with its heads split over ``tp``.
HANDWRITTEN = {
    "mini-gpt": _mini_gpt,
    "mini-gpt (heads over tp)": functools.partial(_mini_gpt, "tp"),
    "mini-gpt (5 heads)": _mini_gpt_five_heads,
    "reference-llama": _reference_llama,
    "reference-llama (heads over tp)": functools.partial(_reference_llama, "tp"),
}


def main() -> None:
    """The demo: ``torchrun --nproc-per-node 4 examples/handwritten.py`` (see the module docstring)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, (tokens, labels), _ = HANDWRITTEN["reference-llama (heads over tp)"]()
    mesh_sizes = {"dp": 2, "tp": 2}
    if "RANK" not in os.environ:
        print(autopar.plan(model, (tokens, labels), mesh_sizes, cluster="fast-links").summary())
        return
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", tuple(mesh_sizes.values()), mesh_dim_names=tuple(mesh_sizes))
    dmodel = autopar.compile(model, mesh, cluster="fast-links")  # compiled on its first call
    optimizer = None
    for step in range(5):
        torch.manual_seed(step)  # the same global batch on every rank
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
        loss = dmodel(tokens, tokens)
        loss.backward()
        optimizer = optimizer or torch.optim.AdamW(dmodel.parameters(), lr=1e-3)  # parameters exist now
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
