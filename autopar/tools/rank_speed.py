"""What one rank computes per second, timed with every rank of the world at once.

The rates ``autopar calibrate`` writes into a cluster file (:mod:`autopar.tools.calibrate`):
product FLOP/s per dtype, memory bandwidth, transcendentals, the elementwise functions' rates,
the overhead of one op and of one parameter tensor of the optimizer step. Every rank calls each
function at the same time, so that ranks sharing cores contend as they do in a run
(:func:`together_seconds`). Each takes the ``device`` it times (the CPU unless told): on a GPU a
timing waits for the device to finish (:func:`synchronize`), since its kernels run after their
launch returns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from autopar.ir.options import FULL
from autopar.passes.apply_recompute import Recomputed
from autopar.planning.cost.cluster import AttentionRates
from autopar.planning.cost.step_overheads import FP32_BYTES, update_passes
from autopar.rules.elementwise import TIMED_BACKWARD, TIMED_FUNCTIONS

MEASURED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the largest product timed: on a GPU a 2048-cube is too short to time its arithmetic rather than its launch
_MATMUL_N = {"cpu": 2048, "cuda": 8192}
_MEMORY_NUMEL = 1 << 25  # 128 MiB per fp32 tensor: far beyond any cache
# 256 KiB per fp32 vector on a CPU: in cache, so that exp's arithmetic is what is timed; on a GPU
# 64 MiB, so that its launch is not (exp's arithmetic there runs at the memory's pace anyway)
_EXP_NUMEL = {"cpu": 1 << 16, "cuda": 1 << 24}
_EXP_CALLS = 64  # exps per timed call: one alone is short beside the timer and a scheduler's slice
# 1 MiB per fp32 vector on a CPU: one of a small layer's activations; 64 MiB on a GPU, whose launch
# a 1 MiB vector's few microseconds would time instead (the cost model prices launches per op)
_FUNCTION_NUMEL = {"cpu": 1 << 18, "cuda": 1 << 24}
# calls per timed call: single calls last about a scheduler's slice on ranks sharing cores, and read
# rates far apart from one calibration to the next (docs/cost_model.md)
_FUNCTION_CALLS = 8
# (batch, heads, sequence) of the attention timed, at head dims 64 and 128 (products a head's width
# apart, the same scores): on one CPU thread a call long enough to time, short enough to repeat
_ATTENTION = {"cpu": (1, 2, 1024), "cuda": (4, 16, 2048)}
_CHAIN = 64  # links of the tiny autograd chain timed for the per-op overhead
_BLOCK_LAYERS = 4  # layers of the small transformer block timed for a recompute region's unit
_STEPPED = 64  # parameter tensors of the optimizer step timed per tensor
_STEPPED_NUMEL = 1 << 10  # elements of each: their bytes move in a few microseconds


def synchronize(device: torch.device | str) -> None:
    """Wait for the work launched on ``device`` (a no-op on the CPU, whose ops return done)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2, device: str = "cpu") -> float:
    # Median, not min: on a shared host single calls stall for a scheduler tick now and then,
    # and the plan should price the typical call, not the luckiest.
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def together_seconds(fn: Callable[[], object], repeats: int, device: str = "cpu") -> float:
    """Seconds per call of ``fn`` when every rank calls it ``repeats`` times at once: the wall time
    from a barrier to the barrier after the last rank's last call (its device done with them). On
    ranks sharing cores the scheduler runs them unevenly, and the first to finish hands its share
    to the others, as in a step whose ranks meet at a collective: a rank's own median would
    flatter the unlucky ones'."""
    fn()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def matmul_flops(dtype: torch.dtype, device: str = "cpu") -> float:
    # The largest square up to _MATMUL_N whose product takes under 50 ms: a dtype the CPU has no
    # fast kernel for (fp16 on some, docs/cost_model.md) is timed on a small one rather than for minutes.
    n = 256
    while n < _MATMUL_N[torch.device(device).type] and _one_product_seconds(n, dtype, device) < 0.05:
        n *= 2
    # every rank the same size, so that all of them compute until the barrier
    size = torch.tensor(n, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MIN)
    n = int(size)
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n**3 / together_seconds(lambda: torch.mm(a, b), 11, device)


def _one_product_seconds(n: int, dtype: torch.dtype, device: str) -> float:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    # one warm-up: a process's first product loads its kernels, which takes longer than the
    # search's 50 ms and would stop it at the smallest size, far below the rate
    return median_seconds(lambda: torch.mm(a, b), 1, warmup=1, device=device)


def memory_bandwidth(device: str = "cpu") -> float:
    # filled, not random: an add's speed does not depend on its values, and drawing 3 x 2^25
    # random numbers costs far more than the adds timed (calibrate calls it 11 times per rank)
    x, y, out = (torch.ones(_MEMORY_NUMEL, device=device) for _ in range(3))
    # add reads two buffers and writes one
    return 3 * x.nbytes / together_seconds(lambda: torch.add(x, y, out=out), 11, device)


def host_speed() -> tuple[float, float]:
    """``(float32 FLOP/s, memory bytes/s)`` of the world's slowest rank, measured as ``autopar
    calibrate`` measures ``peak_flops`` and ``memory_bandwidth_Bps`` (call it on every rank, with
    the threads per rank a calibration gives them): a run compares them with its cluster file to
    tell a host that changed speed since the calibration from a model that priced it wrong."""
    speeds = torch.tensor([matmul_flops(torch.float32), memory_bandwidth()], dtype=torch.float64)
    dist.all_reduce(speeds, op=dist.ReduceOp.MIN)
    return float(speeds[0]), float(speeds[1])


def transcendentals(device: str = "cpu") -> float:
    """exp values per second on one rank (the rate of exp, log, erf and the like, which a CPU
    computes far below its product FLOP/s); on a vector in cache so that memory does not count."""
    numel = _EXP_NUMEL[torch.device(device).type]
    x, out = torch.rand(numel, device=device), torch.empty(numel, device=device)
    return _values_per_second(lambda: torch.exp(x, out=out), numel, _EXP_CALLS, device)


def attention_times(device: str = "cpu") -> tuple[float, float, float]:
    """Median seconds of ``scaled_dot_product_attention``'s forward and backward (fp32, the
    shape :data:`_ATTENTION` names for the device) at head dim 64, at 128, and at 64 under the
    causal mask, the three called in turns on every rank at once (see :func:`_in_turns`):
    :func:`attention_rates` fits them."""
    batch, heads, length = _ATTENTION[torch.device(device).type]

    def call(head_dim: int, causal: bool) -> Callable[[], None]:
        shape = (batch, heads, length, head_dim)
        q, k, v = (torch.randn(shape, device=device, requires_grad=True) for _ in range(3))
        grad = torch.ones(shape, device=device)
        return lambda: torch.autograd.backward(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), grad
        )

    narrow, wide, causal = _in_turns([call(64, False), call(128, False), call(64, True)], 7, device)
    return narrow, wide, causal


def attention_rates(times: tuple[float, float, float], peak: float, device: str = "cpu") -> AttentionRates:
    """The :class:`~autopar.planning.cost.cluster.AttentionRates` of :func:`attention_times`, against the
    product rate ``peak``: the two head dims' difference is a head's products (``flop_scale``),
    the rest of the narrow call is per score (``score_s``), and the causal call's share of it
    gives the key block the kernel skips by (``causal_block``)."""
    narrow, wide, causal = times
    batch, heads, length = _ATTENTION[torch.device(device).type]
    scores = batch * heads * length * length
    counted = 3 * 2 * scores * 2 * 64  # the rule's forward products at head dim 64, and backward's
    # a head's products run no faster than a large product, nor take longer than the whole call:
    # on ranks outnumbering their cores the calls' difference can read faster (docs/cost_model.md)
    per_flop = min(max((wide - narrow) / counted, 1 / peak), narrow / counted)
    score_s = max(narrow - per_flop * counted, 0.0) / scores  # 0 but for rounding at the upper bound
    block = length * min(1.0, max(0.0, 2 * causal / narrow - 1))
    return AttentionRates(flop_scale=per_flop * peak, score_s=score_s, causal_block=block)


def _values_per_second(call: Callable[[], object], values: int, calls: int, device: str) -> float:
    """Values per second of ``call`` (``values`` each), timed ``calls`` at a time on every rank at
    once (:func:`together_seconds`)."""

    def repeated() -> None:
        for _ in range(calls):
            call()

    return values * calls / together_seconds(repeated, 11, device)


def function_rates(device: str = "cpu") -> dict[str, float]:
    """Values per second one rank computes of each of
    :data:`~autopar.rules.elementwise.TIMED_FUNCTIONS` (``<name>_backward`` for those whose
    backward :data:`~autopar.rules.elementwise.TIMED_BACKWARD` times too), on vectors of the
    size a layer's activations have, in fp32 (``Cluster.function_rates``)."""
    numel = _FUNCTION_NUMEL[torch.device(device).type]
    x = torch.rand(numel, device=device) + 0.5  # log's domain
    grad = torch.rand(numel, device=device)
    rates = {}
    for name, (op, kwargs) in TIMED_FUNCTIONS.items():
        rates[name] = _values_per_second(partial(op, x, **kwargs), numel, _FUNCTION_CALLS, device)
    for name, (op, kwargs) in TIMED_BACKWARD.items():
        backward = partial(op, grad, x, **kwargs)
        rates[f"{name}_backward"] = _values_per_second(backward, numel, _FUNCTION_CALLS, device)
    return rates


def host_link(device: str) -> float:
    """Bytes per second one rank copies between ``device`` and the host, one direction, by pageable
    copies each way, as optimizer offload copies gradients and parameters (``Cluster.host_link_Bps``)."""
    on_device, host = torch.rand(_MEMORY_NUMEL, device=device), torch.empty(_MEMORY_NUMEL)

    def both_ways() -> None:
        host.copy_(on_device)
        on_device.copy_(host)

    return 2 * host.nbytes / together_seconds(both_ways, 5, device)


def op_overhead(device: str = "cpu") -> float:
    """Seconds per executed op, besides its arithmetic: a chain of :data:`_CHAIN` products of 4 x 4
    matrices that need gradients, forward and backward, runs three ops per link (a product
    forward, two backward), each too small for its arithmetic to count; launch, dispatch and the
    autograd engine's bookkeeping are what is timed, as a training step's ops pay them. The
    forward runs as the compiled program's code does, a ``GraphModule`` calling ATen's overloads
    (whose Python entry costs more per op than a tensor method's, docs/cost_model.md)."""
    return together_seconds(_chain(device), 25, device) / (3 * _CHAIN)


def recompute_overhead(device: str = "cpu", selective: bool = True) -> float:
    """Seconds a recompute region costs per unit of its work: one unit per op it runs and one per
    tensor autograd saves for them. Timed on :data:`_BLOCK_LAYERS` layers of a small pre-norm
    transformer block (:func:`_block_program`), each run as the runtime runs a recompute region
    (:class:`~autopar.passes.apply_recompute.Recomputed`, the full policy) less the plain layers:
    the ops' second launch in backward, the checkpoint's hooks packing and unpacking every saved
    tensor, and where ``selective`` the selective checkpoint's policy consulted for each op in
    forward and again in recompute (``Cluster.recompute_unit_s``; without it, a full region of
    plain ops, ``Cluster.checkpoint_unit_s``). A chain of one op kind misprices a model's regions:
    the cost per op differs several times between op kinds (docs/cost_model.md)."""
    program, inputs = _block_program(device)
    regions = [Recomputed(program, FULL) for _ in range(_BLOCK_LAYERS)]
    for region in regions:
        region.selective = selective

    def run(layers: list[torch.nn.Module]) -> None:
        y = inputs[0]
        for layer in layers:
            y = layer(y, *inputs[1:])[0]
        y.sum().backward()

    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        program(*inputs)
    units = sum(n.op == "call_function" for n in program.graph.nodes) + len(packed)
    plain, recomputed = partial(run, [program] * _BLOCK_LAYERS), partial(run, regions)
    extra = _paired_extra(plain, recomputed, 41, device)
    return max(0.0, extra / (units * _BLOCK_LAYERS))


def _paired_extra(base: Callable[[], None], more: Callable[[], None], calls: int, device: str) -> float:
    """Seconds ``more`` takes beyond ``base``: the difference of their medians per call, the two
    called in turns (:func:`_in_turns`)."""
    plain, extra = _in_turns([base, more], calls, device)
    return extra - plain


def _in_turns(fns: list[Callable[[], None]], calls: int, device: str) -> list[float]:
    """The median seconds per call of each of ``fns``, called in turns ``calls`` times each, on every
    rank at once (between barriers). Timed in turns, a slow stretch of the host (a scheduler tick,
    a collection of the many small objects a checkpoint's hooks make, ranks outnumbering cores)
    weighs on all alike, where timed apart it can fall on one alone and turn a difference of two
    negative (docs/cost_model.md)."""
    for fn in fns:
        fn()
    synchronize(device)
    dist.barrier()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, timed in zip(fns, times):
            start = time.perf_counter()
            fn()
            synchronize(device)
            timed.append(time.perf_counter() - start)
    dist.barrier()
    return [statistics.median(t) for t in times]


def _block_program(device: str) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A pre-norm transformer block as the compiled program calls it (a ``GraphModule`` of the ATen
    overloads ``torch.export`` captures: layer norms, ``linear`` on 3-D activations, the heads'
    views, causal attention, tanh GELU, residual adds), too small for its arithmetic to count, and
    its inputs: an activation that needs a gradient and the parameters."""
    batch, seq, width, heads = 8, 8, 16, 2
    aten, graph = torch.ops.aten, torch.fx.Graph()
    shapes = {
        "x": (batch, seq, width),
        "ln1_w": (width,),
        "ln1_b": (width,),
        "ln2_w": (width,),
        "ln2_b": (width,),
    }
    for name, out_features in [("q", width), ("k", width), ("v", width), ("o", width), ("fc", 4 * width)]:
        shapes |= {f"{name}_w": (out_features, width), f"{name}_b": (out_features,)}
    shapes |= {"proj_w": (width, 4 * width), "proj_b": (width,)}
    n = {name: graph.placeholder(name) for name in shapes}

    def call(op: object, *args: object, **kwargs: object) -> torch.fx.Node:
        return graph.call_function(op, args, kwargs)

    def linear(y: torch.fx.Node, name: str) -> torch.fx.Node:
        return call(aten.linear.default, y, n[f"{name}_w"], n[f"{name}_b"])

    def heads_of(y: torch.fx.Node) -> torch.fx.Node:
        return call(aten.transpose.int, call(aten.view.default, y, [batch, seq, heads, width // heads]), 1, 2)

    normed = call(aten.layer_norm.default, n["x"], [width], n["ln1_w"], n["ln1_b"], 1e-5, False)
    q, k, v = (heads_of(linear(normed, name)) for name in "qkv")
    attended = call(aten.scaled_dot_product_attention.default, q, k, v, None, 0.0, True)
    merged = call(aten.reshape.default, call(aten.transpose.int, attended, 1, 2), [batch, seq, width])
    hidden = call(aten.add.Tensor, n["x"], linear(merged, "o"))
    normed = call(aten.layer_norm.default, hidden, [width], n["ln2_w"], n["ln2_b"], 1e-5, False)
    mlp = linear(call(aten.gelu.default, linear(normed, "fc"), approximate="tanh"), "proj")
    graph.output((call(aten.add.Tensor, hidden, mlp),))
    inputs = [torch.randn(shape, device=device, requires_grad=True) for shape in shapes.values()]
    return torch.fx.GraphModule(torch.nn.Module(), graph), inputs


def _chain(device: str) -> Callable[[], None]:
    """Forward and backward of the chain of :data:`_CHAIN` products: one graph of ``aten.mm``
    calls, as the compiled program calls its ops."""
    weights = [torch.randn(4, 4, device=device, requires_grad=True) for _ in range(_CHAIN)]
    x = torch.randn(4, 4, device=device)
    graph = torch.fx.Graph()
    y, ws = graph.placeholder("x"), [graph.placeholder(f"w{i}") for i in range(_CHAIN)]
    for w in ws:
        y = graph.call_function(torch.ops.aten.mm.default, (y, w))
    graph.output((y,))
    program = torch.fx.GraphModule(torch.nn.Module(), graph)

    def chain() -> None:
        program(x, *weights)[0].sum().backward()

    return chain


def optimizer_tensor(bandwidth: float, device: str = "cpu") -> float:
    """Seconds torch's AdamW spends per parameter tensor of a step besides moving its bytes (at
    ``bandwidth``), on DTensor parameters replicated over the world, as the compiled module's
    are: each of its ops goes through DTensor's dispatch (``Cluster.optimizer_tensor_s``)."""
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    params = []
    for _ in range(_STEPPED):
        zeros, ones = torch.zeros(_STEPPED_NUMEL, device=device), torch.ones(_STEPPED_NUMEL, device=device)
        p = torch.nn.Parameter(DTensor.from_local(zeros, mesh, [Replicate()]))
        p.grad = DTensor.from_local(ones, mesh, [Replicate()])
        params.append(p)
    step = torch.optim.AdamW(params, lr=1e-3).step
    values, states = update_passes(2)
    moved = _STEPPED_NUMEL * (values + states) * FP32_BYTES / bandwidth
    return max(0.0, together_seconds(step, 11, device) / _STEPPED - moved)
