"""Fuzzing against one device: random models, meshes, annotations and memory options, each planned,
compiled and trained for a step on 4 real gloo ranks, then compared with one device.

A case is drawn from its seed alone (:func:`draw`): a model from a small grammar of the ops the
rule table covers (an embedding or a dense input; blocks of attention with heads, MLPs with
GELU/ReLU/SiLU, LayerNorm/RMSNorm, a convolution over the sequence, a gate, centring by a mean;
a head with cross entropy or a squared error), a mesh of 1-3 axes over the 4 ranks (size-1 axes
included, sometimes a pipeline axis), MindSpore-style annotations (Megatron column/row plans,
a vocabulary split, a batch split), recompute of some blocks, a ZeRO stage and, in a quarter of the
cases, a time limit so tight that the planner merges mesh axes (``autopar.planning.graph.axis_groups``).
Each case's loss and every gradient must equal one device's; a clear ``autopar.AutoparError``
refusing the case counts as *refused*, anything else as a failure, printed with its seed.

    python bench/fuzz.py --cases 200            # the tally and every failure, with its seed
    python bench/fuzz.py --seeds 17,42          # replay some cases

All cases run in one world of 4 gloo ranks (starting ranks is the slow part).
"""

from __future__ import annotations

import argparse
import copy
import random
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.runtime.module import DistributedModule
from autopar.tools.launch import spawn

WORLD = 4
B, T, D, H, C = 4, 8, 16, 32, 12


@dataclass
class Case:
    """What one seed draws (see the module docstring)."""

    seed: int
    blocks: list[str]
    embed: int  # vocabulary size, 0 for a dense input
    loss: str
    mesh: tuple[tuple[str, int], ...]
    pipeline: bool
    annotations: list[str] = field(default_factory=list)  # in words, for the report
    zero: int = 0
    time_limit: float = 10.0  # a tight one makes the planner merge mesh axes (planning/axis_groups)

    def describe(self) -> str:
        mesh = "x".join(f"{n}={s}" for n, s in self.mesh)
        return (
            f"seed {self.seed}: {'embed(' + str(self.embed) + ')' if self.embed else 'dense'} -> "
            f"{' -> '.join(self.blocks)} -> {self.loss}; mesh {mesh}{' pipeline' if self.pipeline else ''}; "
            f"zero={self.zero}; time_limit={self.time_limit:g}; "
            f"{', '.join(self.annotations) or 'no annotations'}"
        )


class Block(nn.Module):
    """One block of the grammar, residual where its output has the input's shape."""

    def __init__(self, kind: str, heads: int, causal: bool, act: str) -> None:
        super().__init__()
        self.kind, self.heads, self.causal, self.act = kind, heads, causal, act
        if kind == "attn":
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        elif kind == "mlp":
            self.up, self.down = nn.Linear(D, H), nn.Linear(H, D, bias=False)
        elif kind == "layernorm":
            self.norm = nn.LayerNorm(D)
        elif kind == "rmsnorm":
            self.norm = nn.RMSNorm(D)
        elif kind == "conv":
            self.conv = nn.Conv1d(D, D, 3, padding=1)
        elif kind == "gate":
            self.gate = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "attn":
            b, t, _ = x.shape  # a pipeline's microbatch has fewer rows than the batch
            q, k, v = (
                p(x).view(b, t, self.heads, D // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            return x + self.o(y.transpose(1, 2).reshape(b, t, D))
        if self.kind == "mlp":
            return x + self.down(getattr(F, self.act)(self.up(x)))
        if self.kind in ("layernorm", "rmsnorm"):
            return self.norm(x)
        if self.kind == "conv":
            return x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        if self.kind == "gate":
            return x * torch.sigmoid(self.gate(x))
        return x - x.mean(dim=-1, keepdim=True)  # "centre"


class Fuzzed(nn.Module):
    """The drawn model: input, blocks, head and loss (the loss is its output)."""

    def __init__(self, case: Case, rng: random.Random) -> None:
        super().__init__()
        self.case = case
        self.embed = nn.Embedding(case.embed, D) if case.embed else None
        self.blocks = nn.ModuleList(
            Block(k, rng.choice([2, 4]), rng.random() < 0.5, rng.choice(["gelu", "relu", "silu"]))
            for k in case.blocks
        )
        self.head = nn.Linear(D, C)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        if self.case.loss == "cross_entropy":
            return F.cross_entropy(logits.reshape(-1, C), target.reshape(-1))
        return (logits - target).square().mean()


def _mesh(rng: random.Random) -> tuple[tuple[tuple[str, int], ...], bool]:
    shapes = [(4,), (2, 2), (1, 4), (4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)]
    shape = rng.choice(shapes)
    if len(shape) >= 2 and shape[0] == 2 and rng.random() < 0.15:
        names = ("pp", *rng.sample(["dp", "tp"], len(shape) - 1))
        return tuple(zip(names, shape)), True
    names = tuple(rng.sample(["dp", "tp", "sp"], len(shape)))
    return tuple(zip(names, shape)), False


def draw(seed: int) -> tuple[Case, nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The case, model and inputs of ``seed`` (the same on every rank and every run)."""
    rng = random.Random(seed)
    kinds = ["attn", "mlp", "layernorm", "rmsnorm", "conv", "gate", "centre"]
    mesh, pipeline = _mesh(rng)
    case = Case(
        seed=seed,
        blocks=[rng.choice(kinds) for _ in range(rng.randint(2 if pipeline else 1, 4))],
        embed=rng.choice([0, 64, 61]),
        loss=rng.choice(["cross_entropy", "squared_error"]),
        mesh=mesh,
        pipeline=pipeline,
    )
    torch.manual_seed(seed)
    model = Fuzzed(case, rng)
    _annotate(model, case, rng)
    case.time_limit = 0.5 if rng.random() < 0.25 else 10.0  # drawn last: earlier draws stay as they were
    x = torch.randint(0, case.embed, (B, T)) if case.embed else torch.randn(B, T, D)
    target = torch.randint(0, C, (B, T)) if case.loss == "cross_entropy" else torch.randn(B, T, C)
    return case, model, (x, target)


def _annotate(model: Fuzzed, case: Case, rng: random.Random) -> None:
    """MindSpore-style annotations over the mesh's axes of size > 1 (not the pipeline's)."""
    axes = [n for n, s in case.mesh if s > 1 and n != "pp"]
    if not axes:
        return
    for i, block in enumerate(model.blocks):
        axis = rng.choice(axes)
        if block.kind == "mlp" and rng.random() < 0.5:
            autopar.shard(block, parameter_plan={"up.weight": (axis, None), "down.weight": (None, axis)})
            case.annotations.append(f"blocks.{i} Megatron MLP over {axis}")
        elif block.kind == "attn" and rng.random() < 0.4:
            plan = {f"{n}.weight": (axis, None) for n in "qkv"}
            autopar.shard(block, parameter_plan={**plan, "o.weight": (None, axis)})
            case.annotations.append(f"blocks.{i} attention by heads over {axis}")
        if rng.random() < 0.2 and not case.pipeline:
            autopar.recompute(block, rng.choice(["full", "selective"]))
            case.annotations.append(f"recompute blocks.{i}")
    if model.embed is not None and rng.random() < 0.4:
        axis = rng.choice(axes)
        autopar.shard(model.embed, parameter_plan={"weight": (axis, None)})
        case.annotations.append(f"vocabulary over {axis}")
    if rng.random() < 0.3:
        axis = rng.choice(axes)
        autopar.shard(model, in_strategy=((axis, None) + ((None,) * (0 if case.embed else 1)), None))
        case.annotations.append(f"batch over {axis}")
    if not case.pipeline and rng.random() < 0.4:
        case.zero = rng.choice([1, 2, 3])


def run_case(seed: int) -> str:
    """Plan, compile and train ``seed``'s case for a step on this world; ``"ok"``, ``"refused: ..."``
    or ``"FAILED: ..."``."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        case, model, (x, target) = draw(seed)
    except autopar.AutoparError as exc:
        return f"refused: {_line(exc)}"
    reference = copy.deepcopy(model)
    names, shape = tuple(n for n, _ in case.mesh), tuple(s for _, s in case.mesh)
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        options = {"memory": autopar.Memory(zero=case.zero)}
        if case.pipeline:
            options = {"pipeline": autopar.Pipeline(2)}
        dmodel = autopar.compile(
            model, mesh, (x, target), cluster="fast-links", time_limit=case.time_limit, **options
        )
        optimizer = dmodel.optimizer(torch.optim.SGD, lr=0.1)
        loss = dmodel.train_step((x, target))
        want = reference(x, target)
        want.backward()
        if not torch.allclose(loss, want.detach(), atol=1e-4, rtol=1e-4):
            return f"FAILED: loss {loss.item():.6f}, one device {want.item():.6f}"
        for name, p in dmodel.named_parameters():
            grad = _full_grad(dmodel, p)
            ref = reference.get_parameter(name).grad
            if (grad is None) != (ref is None) or (
                grad is not None and not torch.allclose(grad, ref, atol=1e-4, rtol=1e-3)
            ):
                return f"FAILED: gradient of {name} differs from one device's"
        optimizer.step()
        return "ok"
    except autopar.AutoparError as exc:
        return f"refused: {_line(exc)}"
    except Exception as exc:  # noqa: BLE001 - a fuzzer reports every failure
        where = traceback.extract_tb(exc.__traceback__)[-1]
        at = f"{where.filename.split('/')[-1]}:{where.lineno}"
        return f"FAILED: {_line(exc)} ({at})"


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _full_grad(dmodel: DistributedModule, p: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of ``p`` (ZeRO-2 keeps it on the shard only)."""
    shard = dmodel.zero_shards.get(id(p))
    if shard is not None and shard.shard.grad is not None:
        return shard.shard.grad.full_tensor()
    return None if p.grad is None else p.grad.full_tensor()


def _world(seeds: list[int]) -> list[tuple[int, str, float]]:
    out = []
    for seed in seeds:
        t0 = time.perf_counter()
        out.append((seed, run_case(seed), time.perf_counter() - t0))
    return out


def fuzz(seeds: list[int]) -> list[tuple[int, str, float]]:
    """Every seed's outcome (see :func:`run_case`), run on one world of 4 gloo ranks."""
    results = spawn(_world, WORLD, seeds)
    # a case fails if it fails on any rank
    merged = []
    for i, (seed, outcome, seconds) in enumerate(results[0]):
        worst = next((r[i][1] for r in results if r[i][1].startswith("FAILED")), outcome)
        merged.append((seed, worst, seconds))
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--seeds", help="replay these seeds, e.g. 17,42")
    a = parser.parse_args()
    seeds = (
        [int(s) for s in a.seeds.split(",")] if a.seeds else list(range(a.first_seed, a.first_seed + a.cases))
    )
    t0 = time.perf_counter()
    results = fuzz(seeds)
    tally = {"ok": 0, "refused": 0, "FAILED": 0}
    for seed, outcome, _ in results:
        tally[outcome.split(":")[0]] += 1
        if outcome != "ok":
            print(f"{draw(seed)[0].describe()}\n    {outcome}")
    print(
        f"{len(results)} cases in {time.perf_counter() - t0:.0f} s: {tally['ok']} ok, "
        f"{tally['refused']} refused with an AutoparError, {tally['FAILED']} failed"
    )


if __name__ == "__main__":
    main()
