"""The per-axis collectives of ``autopar.runtime.collectives``.

One spawned world of 4 gloo ranks on a named 2x2 mesh checks every op on both axes, then
on a 1-D mesh of all 4 ranks: forward result, backward gradient and byte counters,
against expectations computed by hand from global tensors that every rank draws from the
same seed. A rank records every mismatch and raises them all at the end, so each rank
issues the same collectives whatever fails, and ``mp.spawn`` re-raises the message here.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh

from autopar.runtime import collectives as C
from autopar.runtime import pieces
from autopar.tools.launch import free_port

SHAPE = (4, 8, 12)  # every dimension divides by 2 and by 4


def _chunk(t: torch.Tensor, dim: int, n: int, c: int) -> torch.Tensor:
    return t.chunk(n, dim)[c]


def _share(t: torch.Tensor, k: int) -> torch.Tensor:
    """Coordinate k's local value of a Partial tensor; distinct per coordinate."""
    return t * (k + 1)


def _total(t: torch.Tensor, n: int) -> torch.Tensor:
    """The value of a Partial tensor whose coordinate k holds ``_share(t, k)``."""
    return sum((_share(t, k) for k in range(n)), torch.zeros_like(t))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Case:
    """One op call: local input and upstream gradient, expected output, gradient and bytes."""

    name: str
    op: Callable[..., torch.Tensor]
    args: tuple
    x: torch.Tensor
    upstream: torch.Tensor
    out: torch.Tensor
    grad: torch.Tensor
    forward_bytes: dict[str, int] = field(default_factory=dict)
    backward_bytes: dict[str, int] = field(default_factory=dict)
    differentiable: bool = True


def _cases(axis: str, g: torch.Tensor, h: torch.Tensor) -> list[Case]:
    """Every op on ``axis``; ``g`` is the global value, ``h`` the global upstream gradient."""
    _, n, c = C.axis_info(axis)

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        return _chunk(t, dim, n, c)

    spread = torch.zeros_like(g)
    part(spread, 1).copy_(part(g, 1))
    cases = []
    for dim in (0, 2):  # dim 0 takes the collectives' no-copy path
        cases += [
            Case(
                f"all_gather dim {dim} grad reduce_scatter",
                C.all_gather,
                (dim, axis, "reduce_scatter"),
                part(g, dim),
                _share(h, c),
                g,
                part(_total(h, n), dim),
                {"all_gather": _nbytes(part(g, dim))},
                {"reduce_scatter": _nbytes(h)},
            ),
            Case(
                f"reduce_scatter dim {dim}",
                C.reduce_scatter,
                (dim, axis),
                _share(g, c),
                part(h, dim),
                part(_total(g, n), dim),
                h,
                {"reduce_scatter": _nbytes(g)},
                {"all_gather": _nbytes(part(h, dim))},
            ),
        ]
    return cases + [
        Case(
            "all_gather dim 1 grad slice",
            C.all_gather,
            (1, axis, "slice"),
            part(g, 1),
            h,
            g,
            part(h, 1),
            {"all_gather": _nbytes(part(g, 1))},
        ),
        Case(
            "all_reduce grad identity",
            C.all_reduce,
            (axis, "identity"),
            _share(g, c),
            h,
            _total(g, n),
            h,
            {"all_reduce": _nbytes(g)},
        ),
        Case(
            "all_reduce grad all_reduce",
            C.all_reduce,
            (axis, "all_reduce"),
            _share(g, c),
            _share(h, c),
            _total(g, n),
            _total(h, n),
            {"all_reduce": _nbytes(g)},
            {"all_reduce": _nbytes(h)},
        ),
        Case(
            "all_to_all 0 -> 2",
            C.all_to_all,
            (0, 2, axis),
            part(g, 0),
            part(h, 2),
            part(g, 2),
            part(h, 0),
            {"all_to_all": _nbytes(part(g, 0))},
            {"all_to_all": _nbytes(part(h, 2))},
        ),
        Case(
            "all_to_all 2 -> 1",
            C.all_to_all,
            (2, 1, axis),
            part(g, 2),
            part(h, 1),
            part(g, 1),
            part(h, 2),
            {"all_to_all": _nbytes(part(g, 2))},
            {"all_to_all": _nbytes(part(h, 1))},
        ),
        Case(
            "shard dim 1",
            C.shard,
            (1, axis),
            g,
            part(h, 1),
            part(g, 1),
            h,
            {},
            {"all_gather": _nbytes(part(h, 1))},
        ),
        Case(
            "grad_all_reduce",
            C.grad_all_reduce,
            (axis,),
            g,
            _share(h, c),
            g,
            _total(h, n),
            {},
            {"all_reduce": _nbytes(h)},
        ),
        *_strided_cases(axis, g, h),
        *_uneven_cases(axis, g[:, :7], h[:, :7]),
        Case(
            "all_reduce_max",
            C.all_reduce_max,
            (axis,),
            g + c,
            h,
            g + n - 1,
            h,
            {"all_reduce": _nbytes(g)},
            differentiable=False,
        ),
        Case("to_partial from Replicate", C.to_partial, (axis, -1), g, h, g if c == 0 else 0 * g, h),
        Case("to_partial from Shard(1)", C.to_partial, (axis, 1), part(g, 1), h, spread, part(h, 1)),
    ]


def _strided_cases(axis: str, g: torch.Tensor, h: torch.Tensor) -> list[Case]:
    """The ops moving a strided shard of dim 1 in 2 parts: this rank's piece of each part."""
    _, n, c = C.axis_info(axis)

    def pieces(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([_chunk(part, 1, n, c) for part in t.chunk(2, 1)], 1)

    gathered = {"all_gather": _nbytes(pieces(g))}
    return [
        Case(
            "strided shard",
            C.shard,
            (1, axis, 2),
            g,
            pieces(h),
            pieces(g),
            h,
            {},
            {"all_gather": _nbytes(pieces(h))},
        ),
        Case(
            "strided all_gather grad slice",
            C.all_gather,
            (1, axis, "slice", 2),
            pieces(g),
            h,
            g,
            pieces(h),
            gathered,
        ),
        Case(
            "strided all_gather grad reduce_scatter",
            C.all_gather,
            (1, axis, "reduce_scatter", 2),
            pieces(g),
            _share(h, c),
            g,
            pieces(_total(h, n)),
            gathered,
            {"reduce_scatter": _nbytes(h)},
        ),
        Case(
            "strided reduce_scatter",
            C.reduce_scatter,
            (1, axis, 2),
            _share(g, c),
            pieces(h),
            pieces(_total(g, n)),
            h,
            {"reduce_scatter": _nbytes(g)},
            {"all_gather": _nbytes(pieces(h))},
        ),
    ]


def _uneven_cases(axis: str, g: torch.Tensor, h: torch.Tensor) -> list[Case]:
    """The ops moving dim 1 of 7 rows split unevenly (DTensor's pieces: 4 and 3 over 2 ranks)."""
    _, n, c = C.axis_info(axis)

    def piece(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(n, 1)[c]

    spread = torch.zeros_like(g)
    spread.narrow(1, c * -(-7 // n), piece(g).shape[1]).copy_(piece(g))
    whole, cut = {"all_gather": pieces.nbytes(piece(g))}, {"all_gather": pieces.nbytes(piece(h))}
    return [
        Case("uneven shard", C.shard, (1, axis, 1, 7), g, piece(h), piece(g), h, {}, cut),
        Case("uneven all_gather", C.all_gather, (1, axis, "slice", 1, 7), piece(g), h, g, piece(h), whole),
        Case(
            "uneven reduce_scatter",
            C.reduce_scatter,
            (1, axis, 1, 7),
            _share(g, c),
            piece(h),
            piece(_total(g, n)),
            h,
            {"reduce_scatter": pieces.nbytes(g)},
            cut,
        ),
        Case(
            "uneven all_to_all 1 -> 2",
            C.all_to_all,
            (1, 2, axis, 7, 0),
            piece(g),
            _chunk(h, 2, n, c),
            _chunk(g, 2, n, c),
            piece(h),
            {"all_to_all": pieces.nbytes(piece(g))},
            {"all_to_all": pieces.nbytes(_chunk(h, 2, n, c))},
        ),
        Case(
            "uneven all_to_all 2 -> 1",
            C.all_to_all,
            (2, 1, axis, 0, 7),
            _chunk(g, 2, n, c),
            piece(h),
            piece(g),
            _chunk(h, 2, n, c),
            {"all_to_all": pieces.nbytes(_chunk(g, 2, n, c))},
            {"all_to_all": pieces.nbytes(piece(h))},
        ),
        Case("uneven to_partial", C.to_partial, (axis, 1, 7), piece(g), h, spread, piece(h)),
    ]


def _run(case: Case, axis: str) -> list[str]:
    """Run ``case``'s forward and backward; one message per mismatch."""
    failures = []

    def check(what: str, actual: object, expected: object) -> None:
        if not isinstance(expected, torch.Tensor):
            problem = f"is {actual}, expected {expected}" if actual != expected else ""
        elif actual.shape != expected.shape:
            problem = f"has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        else:
            error = (actual - expected).abs().max().item()
            problem = f"is off by up to {error:.3g}" if error > 1e-9 else ""
        if problem:
            failures.append(f"{case.name} on {axis!r}: {what} {problem}")

    C.reset_comm_counts()
    x = case.x.clone().requires_grad_(case.differentiable)
    out = case.op(x, *case.args)
    check("output", out.detach(), case.out)
    check("forward bytes", C.comm_counts(), {(k, axis): b for k, b in case.forward_bytes.items()})
    if not case.differentiable:
        return failures
    C.reset_comm_counts()
    out.backward(case.upstream)
    check("gradient", x.grad, case.grad)
    check("backward bytes", C.comm_counts(), {(k, axis): b for k, b in case.backward_bytes.items()})
    check("backward calls", C.collective_calls(), {(k, axis): 1 for k in case.backward_bytes})
    return failures


def _rank_main(rank: int, port: int, world_size: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        # A rank that stops issuing collectives fails the others soon instead of hanging the suite.
        timeout=timedelta(seconds=60),
    )
    try:
        gen = torch.Generator().manual_seed(0)
        g = torch.randn(SHAPE, dtype=torch.float64, generator=gen)
        h = torch.randn(SHAPE, dtype=torch.float64, generator=gen)
        failures = []
        C.register_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
        for axis in ("dp", "tp"):
            failures += [f for case in _cases(axis, g, h) for f in _run(case, axis)]
        C.register_mesh(init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",)))
        if C.axis_info("world")[1:] != (world_size, rank):
            failures.append(f"axis_info('world') is {C.axis_info('world')}")
        failures += [f for case in _cases("world", g, h) for f in _run(case, "world")]
    finally:
        dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}:\n" + "\n".join(failures))


@pytest.mark.distributed
def test_collectives_on_gloo_ranks():
    # A fork server that imports torch and autopar once (and torch._dynamo, which a custom op's
    # first call imports) starts the ranks ~3x faster than spawn, which imports them in every
    # rank; it forks before any torch thread pool exists, which forking pytest would not.
    # Modules of the environment, not this file: Python 3.11's fork server ignores sys.path.
    # Were a fork server already running, the ranks would import on their own: slower, same result.
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["autopar.runtime.collectives", "torch._dynamo"]
    )
    # A rank's exception (with its message) is re-raised here and the other ranks are stopped.
    mp.start_processes(_rank_main, args=(free_port(), 4), nprocs=4, start_method="forkserver")


# --------------------------------------------------------------------------- without communication


def test_registry_counters_and_fake_shapes(fake_process_group):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    C.register_mesh(mesh)
    assert C.axis_info("dp")[1:] == (2, 0) and C.axis_info("tp").size == 2
    with pytest.raises(ValueError, match=r"'pp' is not registered; registered axes are \['dp', 'tp'\]"):
        C.axis_info("pp")

    with FakeTensorMode():
        x = torch.empty(4, 6, 8)
        assert C.all_gather(x, 1, "dp", "slice").shape == (4, 12, 8)
        assert C.reduce_scatter(x, 2, "tp").shape == (4, 6, 4)
        assert C.all_reduce(x, "dp", "identity").shape == (4, 6, 8)
        assert C.all_to_all(x, 0, 2, "tp").shape == (8, 6, 4)
        assert C.shard(x, 0, "dp").shape == (2, 6, 8)
        assert C.grad_all_reduce(x, "tp").shape == (4, 6, 8)
        assert C.to_partial(x, "dp", -1).shape == (4, 6, 8)
        assert C.to_partial(x, "dp", 1).shape == (4, 12, 8)
        with pytest.raises(ValueError, match="cannot be split into 2 equal parts over mesh axis 'tp'"):
            C.reduce_scatter(torch.empty(4, 5), 1, "tp")
        with pytest.raises(ValueError, match="dim 3 is not a dimension of a 3-d tensor"):
            C.shard(x, 3, "dp")
        with pytest.raises(ValueError, match="grad must be one of"):
            C.all_gather(x, 0, "dp", "identity")
        with pytest.raises(ValueError, match="src_dim and dst_dim are both 1"):
            C.all_to_all(x, 1, 1, "dp")
        with pytest.raises(ValueError, match="'pp' is not registered"):
            C.grad_all_reduce(x, "pp")
        assert C.shard(x, 1, "tp", 3).shape == (4, 3, 8)  # a strided shard: a piece of each of 3 parts
        assert C.all_gather(x, 1, "tp", "slice", 3).shape == (4, 12, 8)

    # a partial maximum is planned only where no gradient flows: one reaching it is an error
    with pytest.raises(RuntimeError, match="autograd"):
        C.all_reduce_max(torch.randn(4, 6, requires_grad=True), "dp").sum().backward()

    # a second mesh naming an axis "dp" too gets its own key; the same mesh again, the same keys
    assert C.register_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))) == {"dp": "dp.1"}
    assert C.register_mesh(mesh) == {"dp": "dp", "tp": "tp"}
    assert C.axis_info("dp.1").size == 4 and C.axis_info("dp").size == 2
    with pytest.raises(ValueError, match="has no axis names"):
        C.register_mesh(init_device_mesh("cpu", (4,)))

    C.reset_comm_counts()
    C.count_collective("all_reduce", "dp", 100)
    C.count_collective("all_reduce", "dp", 20)
    counts = C.comm_counts()
    counts.clear()  # a copy: the module's counter is untouched
    assert C.comm_counts() == {("all_reduce", "dp"): 120}
    assert C.collective_calls() == {("all_reduce", "dp"): 2}
    C.reset_comm_counts()
    assert C.comm_counts() == {} and C.collective_calls() == {}


def test_a_gathered_concatenation_is_contiguous():
    """Gathering a dim of local size 1 (Swin's windows) must give what a later view can take."""
    stacked = torch.arange(2 * 3 * 1 * 4.0).view(2, 3, 1, 4)  # two ranks' (3, 1, 4) pieces
    whole = pieces.concat_stacked(stacked, 1)
    assert whole.is_contiguous()
    torch.testing.assert_close(whole, torch.cat(list(stacked), dim=1))
    assert whole.view(6, 4).shape == (6, 4)


def test_a_sliced_gradient_owns_its_storage(fake_process_group):
    """The backward of a gather whose gradient is the same on every rank takes this rank's piece:
    copied out, so that a parameter stored split (ZeRO-3) does not hold the whole gradient as its
    ``.grad`` (measured: 4x the planned bytes of GPT's position embedding)."""
    C.register_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    x = torch.randn(4, 3, requires_grad=True)
    g = torch.randn(8, 3)
    C.all_gather(x, 0, "dp", "slice").backward(g)
    assert x.grad.untyped_storage().nbytes() == x.grad.numel() * x.grad.element_size()
    torch.testing.assert_close(x.grad, g.chunk(2)[C.axis_info("dp")[2]])
