"""Cost model: formulas on hand-computed numbers, link choice, redistribution plans, presets."""

import json
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ir.mesh import MeshSpec
from autopar.ir.options import dtype_name
from autopar.planning.cost.cluster import AttentionRates
from autopar.planning.cost.model import Cluster, Collective, CostModel, LinkSpec, get_cluster

R, P = Replicate(), Partial()
S0, S1 = Shard(0), Shard(1)

INTRA = LinkSpec(latency_s=1e-5, bandwidth_Bps=1e9)
INTER = LinkSpec(latency_s=1e-4, bandwidth_Bps=1e8)


def toy_cluster(devices_per_node: int = 4) -> Cluster:
    return Cluster(
        name="toy",
        peak_flops={"float32": 1e12, "bfloat16": 4e12},
        memory_bandwidth_Bps=1e11,
        memory_bytes=1 << 30,
        devices_per_node=devices_per_node,
        intra_node=INTRA,
        inter_node=INTER,
    )


def plan(model: CostModel, src, dst, shape=(8, 16), itemsize=4) -> list[tuple[str, str, int]]:
    """(kind, axis, bytes) of each collective, in issue order."""
    collectives, _ = model.redistribute(src, dst, shape, itemsize)
    return [(c.kind, c.mesh_axes[0], c.bytes) for c in collectives]


# --- formulas ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected",
    [
        # n = 4, alpha = 1e-5, B / beta = 1000 B / 1e9 B/s = 1e-6 s
        ("all_gather", 3 * 1e-5 + 3 * 1e-6),
        ("reduce_scatter", 3 * 1e-5 + 0.75 * 1e-6),
        ("all_reduce", 6 * 1e-5 + 1.5 * 1e-6),
        ("all_to_all", 3 * 1e-5 + 0.75 * 1e-6),
    ],
)
def test_collective_time_ring_formulas(kind, expected):
    model = CostModel(MeshSpec(("x",), (4,)), toy_cluster())
    assert model.collective_time(Collective(kind, ("x",), 1000)) == pytest.approx(expected)


def test_collective_on_inter_node_axis_uses_inter_link():
    model = CostModel({"dp": 2, "tp": 4}, toy_cluster(devices_per_node=4))
    # dp crosses nodes: n = 2, alpha = 1e-4, 1000 B / 1e8 B/s = 1e-5 s
    assert model.collective_time(Collective("all_reduce", ("dp",), 1000)) == pytest.approx(2e-4 + 1e-5)


def test_size_one_axis_is_free():
    model = CostModel({"dp": 1, "tp": 4}, toy_cluster())
    assert model.collective_time(Collective("all_reduce", ("dp",), 10**9)) == 0.0


def test_collective_time_rejects_several_or_unknown_axes():
    model = CostModel({"dp": 2, "tp": 4}, toy_cluster())
    with pytest.raises(ValueError, match="one mesh axis"):
        model.collective_time(Collective("all_reduce", ("dp", "tp"), 8))
    with pytest.raises(ValueError, match="unknown mesh axis 'pp'"):
        model.collective_time(Collective("all_reduce", ("pp",), 8))


def test_collective_validates_kind_and_bytes():
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        Collective("broadcast", ("x",), 8)
    with pytest.raises(ValueError, match=">= 0"):
        Collective("all_gather", ("x",), -1)


def test_compute_time_roofline():
    model = CostModel({"x": 2}, toy_cluster())
    # compute bound: 2e12 FLOP at 1e12 FLOP/s beats 1e9 B at 1e11 B/s
    assert model.compute_time(2e12, 1e9, torch.float32) == pytest.approx(2.0)
    # memory bound
    assert model.compute_time(1e9, 1e11, torch.float32) == pytest.approx(1.0)
    # per-dtype peak, and the float32 fallback for dtypes without one
    assert model.compute_time(4e12, 0, torch.bfloat16) == pytest.approx(1.0)
    assert model.compute_time(4e12, 0, torch.float16) == pytest.approx(4.0)
    assert model.compute_time(4e12, 0, torch.int64) == pytest.approx(4.0)


def test_dtype_name():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.float32) == "float32"


# --- links --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh, expected",
    [
        ({"dp": 8, "tp": 8}, ("inter", "intra")),
        # 2 x 4 = 8 devices fill exactly one node, so dp stays inside it too
        ({"dp": 2, "tp": 4}, ("intra", "intra")),
        ({"dp": 4, "tp": 4}, ("inter", "intra")),
        ({"pp": 2, "dp": 4, "tp": 2}, ("inter", "intra", "intra")),
        ({"tp": 16}, ("inter",)),
    ],
)
def test_h100_link_selection(mesh, expected):
    h100 = get_cluster("h100")
    model = CostModel(mesh, h100)
    links = {"intra": h100.intra_node, "inter": h100.inter_node}
    assert tuple(model.link(i) for i in range(len(mesh))) == tuple(links[e] for e in expected)


def test_cpu_gloo_never_leaves_the_host():
    cluster = get_cluster("cpu-gloo")
    model = CostModel({"dp": 64, "tp": 64}, cluster)
    assert model.link(0) == model.link(1) == cluster.intra_node


# --- redistribution: one mesh axis (x = 4), shape (8, 16) fp32 = 512 bytes ---------------


def copied_bytes(model: CostModel, collectives, seconds: float) -> int:
    """The bytes an edge's price reads and writes in the runtime's own copies: its seconds less
    its collectives', at the toy cluster's memory bandwidth."""
    return round((seconds - sum(model.collective_time(c) for c in collectives)) * 1e11)


@pytest.mark.parametrize(
    "src, dst, expected, copied",
    [
        (R, R, [], 0),
        (S0, S0, [], 0),
        (P, P, [], 0),
        (Partial("avg"), P, [], 0),
        (R, S0, [], 0),  # local ops' copies are left free (CostModel._copy_time)
        (R, P, [], 0),
        (S0, P, [], 0),
        (P, R, [("all_reduce", "x", 512)], 2 * 512),  # a clone to reduce in place
        (P, S1, [("reduce_scatter", "x", 512)], 2 * 512),  # chunks of dim 1 stacked
        (S0, R, [("all_gather", "x", 128)], 0),  # dim 0: the gathered stack is the result
        (S0, S1, [("all_to_all", "x", 128)], 2 * 128),  # dim 1's chunks stacked to send
    ],
)
def test_redistribute_1d(src, dst, expected, copied):
    model = CostModel({"x": 4}, toy_cluster())
    collectives, seconds = model.redistribute((src,), (dst,), (8, 16), 4)
    assert [(c.kind, c.mesh_axes[0], c.bytes) for c in collectives] == expected
    assert copied_bytes(model, collectives, seconds) == copied


# --- redistribution: two mesh axes, shape (8, 16) fp32 = 512 bytes -----------------------


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        # all_reduce on the 1/4 shard before the gather regrows it
        ((P, S0), (R, R), [("all_reduce", "a", 128), ("all_gather", "b", 128)]),
        # b leaves dim 0 before a enters it (a slice on a first would hand out the wrong rows)
        ((R, S0), (S0, R), [("all_gather", "b", 128)]),
        # S -> P on a is applied last, so it does not inflate the gather on b
        ((S0, S0), (P, R), [("all_gather", "b", 64)]),
        ((S0, R), (P, S1), []),
        # reduce_scatter shrinks first, then the all_to_all moves 1/8
        ((P, S0), (S1, S1), [("reduce_scatter", "a", 128), ("all_to_all", "b", 64)]),
        ((S0, P), (S1, R), [("all_to_all", "a", 256), ("all_reduce", "b", 256)]),
        ((P, R), (R, P), [("all_reduce", "a", 512)]),
        # equal links: reduce_scatters inner axis first, all_gathers outer axis first
        ((P, P), (S0, S1), [("reduce_scatter", "b", 512), ("reduce_scatter", "a", 128)]),
        ((S0, S1), (R, R), [("all_gather", "a", 64), ("all_gather", "b", 128)]),
    ],
)
def test_redistribute_2d(src, dst, expected):
    model = CostModel({"a": 2, "b": 4}, toy_cluster(devices_per_node=8))
    assert plan(model, src, dst) == expected


def test_redistribute_orders_axes_by_link_speed():
    # dp crosses nodes (slow), tp stays inside (fast); tensor of 1024 bf16 = 2048 bytes
    model = CostModel({"dp": 2, "tp": 8}, get_cluster("h100"))
    shape, itemsize = (32, 32), 2
    # shrink on the fast link first, so the slow link carries 1/8 of the data
    assert plan(model, (P, P), (S0, S1), shape, itemsize) == [
        ("reduce_scatter", "tp", 2048),
        ("reduce_scatter", "dp", 256),
    ]
    # grow on the slow link first, while the data is still small
    assert plan(model, (S0, S1), (R, R), shape, itemsize) == [
        ("all_gather", "dp", 128),
        ("all_gather", "tp", 256),
    ]


def test_one_dim_split_over_two_axes_is_entered_outer_first_and_left_inner_first():
    # DTensor splits a dim over axes in mesh order; the links would suggest the opposite order
    model = CostModel({"dp": 2, "tp": 8}, get_cluster("h100"))
    assert model.steps((P, P), (S0, S0)) == ((0, "reduce_scatter"), (1, "reduce_scatter"))
    assert model.steps((S0, S0), (R, R)) == ((1, "all_gather"), (0, "all_gather"))
    assert model.steps((R, R), (S0, S0)) == ((0, "slice"), (1, "slice"))


def test_backward_runs_the_forward_ops_adjoints_in_reverse():
    model = CostModel({"a": 2, "b": 4}, toy_cluster(devices_per_node=8))
    shape = (8, 16)  # 512 bytes

    def backward(have, need, grad_need, grad_have, copied=0):
        collectives, seconds = model.backward(have, need, grad_need, grad_have, shape, 4)
        assert copied_bytes(model, collectives, seconds) == copied
        return [(c.kind, c.mesh_axes[0], c.bytes) for c in collectives]

    # forward slices a, then b; backward gathers b first (the last slice), then a; b's gather of
    # dim 1 reorders its stack of 4 pieces of 64 bytes, a's of dim 0 is the result as gathered
    assert model.steps((R, R), (S0, S1)) == ((0, "slice"), (1, "slice"))
    assert backward((R, R), (S0, S1), (S0, S1), (R, R), 2 * 4 * 64) == [
        ("all_gather", "b", 64),
        ("all_gather", "a", 256),
    ]
    # ... where redistributing the gradient on its own would gather a first: other bytes per axis
    assert plan(model, (S0, S1), (R, R)) == [("all_gather", "a", 64), ("all_gather", "b", 128)]
    # a gathered value whose consumer hands back partial sums: reduce-scatter; whole ones: a free slice
    assert backward((S0, R), (R, R), (P, R), (S0, R)) == [("reduce_scatter", "a", 512)]
    assert backward((S0, R), (R, R), (R, R), (S0, R)) == []
    # only the gradient changes (Megatron's "f"): an all-reduce in backward; the forward's copy
    # (an identity op must return a new tensor) and the all-reduce's are priced with it
    assert backward((R, R), (R, R), (R, P), (R, R), 2 * 512 + 2 * 512) == [("all_reduce", "b", 512)]
    # no gradient flows, or it keeps its layout: nothing moves
    assert backward((R, R), (S0, R), (R, R), (R, R)) == []


def test_redistribute_total_is_the_sum_of_its_steps_and_their_copies():
    h100 = get_cluster("h100")
    model = CostModel({"dp": 2, "tp": 8}, h100)
    collectives, seconds = model.redistribute((P, S0), (R, R), (64, 64), 2)
    # the all_reduce on dp clones its 1/8 (1024 bytes); the gather of dim 0 on tp copies nothing
    clone = 2 * 1024 / h100.memory_bandwidth_Bps
    assert seconds == pytest.approx(sum(model.collective_time(c) for c in collectives) + clone)


def test_redistribute_is_cached_and_accepts_lists():
    model = CostModel({"a": 2, "b": 4}, toy_cluster())
    first = model.redistribute((P, S0), (R, R), (8, 16), 4)
    assert model.redistribute([P, S0], [R, R], [8, 16], 4) is first


def test_redistribute_rejects_bad_layouts():
    model = CostModel({"a": 2, "b": 4}, toy_cluster())
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        model.redistribute((P,), (R, R), (8, 16), 4)
    with pytest.raises(TypeError, match="unsupported placement"):
        model.redistribute((P, "S0"), (R, R), (8, 16), 4)


# --- presets and serialisation --------------------------------------------------------------


def test_presets_load():
    h100 = get_cluster("h100")
    assert h100.peak_flops["bfloat16"] == 780e12  # a large product's rate, below the datasheet's 989
    assert h100.devices_per_node == 8
    assert h100.inter_node.bandwidth_Bps == 45e9  # NCCL's bus bandwidth over a 50 GB/s NDR port
    cpu = get_cluster("cpu-gloo")
    assert cpu.peak_flops["float32"] > 0 and cpu.memory_bytes > 0
    assert cpu.intra_node.latency_s > 0 and cpu.intra_node.bandwidth_Bps > 0


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match=r"'tpu'.*\['a100', 'cpu-gloo', 'fast-links', 'h100'\]"):
        get_cluster("tpu")


@pytest.mark.parametrize("name", ["cpu-gloo", "h100"])
def test_json_round_trip(name):
    cluster = get_cluster(name)
    back = Cluster.from_dict(json.loads(json.dumps(cluster.to_dict())))
    assert back == cluster
    assert hash(back) == hash(cluster)


def test_cluster_is_immutable_and_validated():
    cluster = toy_cluster()
    with pytest.raises(TypeError):
        cluster.peak_flops["float32"] = 1.0
    with pytest.raises(ValueError, match="'float32' entry"):
        Cluster("bad", {"bfloat16": 1.0}, 1.0, 1, 1, INTRA, INTER)


def test_transcendentals_run_at_their_own_rate_beside_the_flops():
    rated = CostModel({"x": 2}, replace(toy_cluster(), transcendentals_per_s=1e9))
    # 1e12 FLOP (1 s) and 1e9 exps (1 s) add up; memory (1e11 B, 1 s) is the other bound
    assert rated.compute_time(1e12, 1e11, torch.float32, transcendentals=1e9) == pytest.approx(2.0)
    assert CostModel({"x": 2}, toy_cluster()).compute_time(1e12, 0, torch.float32, 1e9) == pytest.approx(1.0)
    # backward: twice the flops and bytes, and its own transcendentals
    assert rated.op_time(0, 1e11, torch.float32, (1e9, 4e9), grad=True) == pytest.approx(1.0 + 4.0)
    assert rated.op_time(0, 1e11, torch.float32, (1e9, 4e9)) == pytest.approx(1.0)


def test_the_plan_prices_the_exps_of_activations_softmax_attention_and_the_loss():
    """A planned model's ops are priced with their rules' transcendentals (GELU's erf, softmax's
    exp, attention's exp per score, cross-entropy's exps and logs)."""
    import autopar

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.gelu(self.fc(x))  # 4 x 8 x 16
            q = h.view(4, 2, 8, 8)
            a = torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(32, 16)
            return torch.nn.functional.cross_entropy(torch.softmax(a, -1), target.flatten())

    args = (torch.randn(4, 8, 16), torch.randint(0, 16, (4, 8)))
    slow = replace(get_cluster("fast-links"), transcendentals_per_s=1.0)  # one exp per second
    seconds = {}
    for cluster in (get_cluster("fast-links"), slow):
        plan = autopar.plan(Block(), args, {"dp": 1}, cluster=cluster)
        seconds[cluster.transcendentals_per_s] = {n.op: n.compute_s for n in plan.nodes}
    extra = {op: round(seconds[1.0][op] - seconds[None][op]) for op in seconds[None]}
    n = 4 * 8 * 16
    assert extra["aten.gelu.default"] == 3 * n  # erf forward; erf and exp backward
    assert extra["aten.scaled_dot_product_attention.default"] == 2 * 4 * 2 * 8 * 8  # each score's exp, twice
    assert extra["aten.softmax.int"] == n  # an exp each; its backward none
    # capture writes cross-entropy out: the exps of its log_softmax, a log per row
    assert (extra["aten.exp.default"], extra["aten.log.default"]) == (n, 32)


def test_timed_functions_are_priced_at_their_calibrated_rates():
    """Where calibrate timed an elementwise function (forward, and backward where it is timed), that
    rate prices the op instead of its transcendental count: GELU's two forms apart, SiLU's
    backward at its own rate, tanh's backward (no function of its own) as before."""
    import autopar

    class Activations(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            exact = torch.nn.functional.gelu(h)
            tanh_form = torch.nn.functional.gelu(h, approximate="tanh")
            return (exact + tanh_form + torch.nn.functional.silu(h) + torch.tanh(h)).sum()

    rates = {"gelu": 1.0, "gelu_backward": 0.5, "gelu_tanh": 0.25, "silu": 2.0, "silu_backward": 0.1}
    rates["tanh"] = 1.0
    base = get_cluster("fast-links")
    seconds = {}
    for name, cluster in {"plain": base, "timed": replace(base, function_rates=rates)}.items():
        plan = autopar.plan(Activations(), (torch.randn(4, 16),), {"dp": 1}, cluster=cluster)
        timed_ops = ("aten.gelu.default", "aten.silu.default", "aten.tanh.default")
        seconds[name] = [n.compute_s for n in plan.nodes if n.op in timed_ops]
    n = 4 * 16
    gelu, gelu_tanh, silu, tanh = (t - p for t, p in zip(seconds["timed"], seconds["plain"]))
    assert gelu == pytest.approx(n / 1.0 + n / 0.5, rel=1e-6)  # the values, at one per second
    assert gelu_tanh == pytest.approx(n / 0.25, rel=1e-6)  # its backward not timed: as before
    assert silu == pytest.approx(n / 2.0 + n / 0.1, rel=1e-6)
    assert tanh == pytest.approx(n / 1.0, rel=1e-6)


def test_attention_is_priced_as_its_fused_kernel_runs_where_calibrated():
    """With the cluster's attention rates, ``scaled_dot_product_attention`` costs its products at
    ``flop_scale`` times the product rate plus a cost per score; under the implicit causal mask
    (queries and keys of one length) a fraction ``(1 + block / length) / 2`` of that, none saved
    with an explicit mask; forward alone a third. Without the rates, as before."""
    import autopar

    class Attention(torch.nn.Module):
        def __init__(self, causal: bool, masked: bool) -> None:
            super().__init__()
            self.causal, self.masked = causal, masked
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.fc(x).view(2, 64, 2, 8).transpose(1, 2)  # batch 2, 2 heads, length 64, dim 8
            mask = torch.ones(64, 64, dtype=torch.bool).tril() if self.masked else None
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, mask, is_causal=self.causal)

    rates = AttentionRates(flop_scale=2.0, score_s=1e-3, causal_block=16.0)
    peaks = {"float32": 1e12, "bfloat16": 4e12}
    base = replace(get_cluster("fast-links"), transcendentals_per_s=1e9, peak_flops=peaks)
    scores, flops = 2 * 2 * 64 * 64, 2 * 2 * 2 * 64 * 64 * 16
    full = 2.0 * 3 * flops / 1e12 + 1e-3 * scores
    x = torch.randn(2, 64, 16)
    for causal, masked, fraction in (
        (False, False, 1.0),
        (True, False, (1 + 16 / 64) / 2),
        (False, True, 1.0),
    ):
        seconds = {}
        for cluster in (base, replace(base, attention=rates)):
            plan = autopar.plan(Attention(causal, masked), (x,), {"dp": 1}, cluster=cluster)
            [seconds[cluster.attention]] = [n.compute_s for n in plan.nodes if "scaled_dot" in n.op]
        assert seconds[rates] == pytest.approx(fraction * full, rel=1e-6)
        assert seconds[None] == pytest.approx(3 * flops / 1e12 + 2 * scores / 1e9, rel=1e-3)
    model = CostModel({"x": 1}, replace(base, attention=rates))
    assert model.op_time(flops, 0, torch.float32, attention=(scores, 0)) == pytest.approx(full / 3)
    assert model.op_time(flops, 0, torch.bfloat16, attention=(scores, 0), grad=True) == pytest.approx(
        2.0 * 3 * flops / 4e12 + 1e-3 * scores
    )


def test_views_and_dropouts_that_drop_nothing_move_no_bytes():
    """An op handing back its operand's memory reshaped (transpose, view, a reshape that needs no
    copy) or a dropout of p 0 costs no compute; a reshape that must copy, a slice (its backward
    writes the operand's size), a dropout that drops and an in-place op (made functional, its
    fake value still shares the storage it wrote) keep their bytes."""
    import autopar

    class Views(torch.nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.fc, self.p = torch.nn.Linear(16, 16), p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.dropout(self.fc(x), self.p, self.training)  # 4 x 8 x 16
            h = h * 1.0
            h.mul_(2.0)
            t = h.view(4, 8, 2, 8).transpose(1, 2)  # views
            copied = t.reshape(4, 2 * 8 * 8)  # not contiguous: a copy
            return (copied[:, :64] + h.reshape(4, 128)[:, 64:]).sum()

    x = torch.randn(4, 8, 16)
    for p, dropout_moves in ((0.0, False), (0.5, True)):
        plan = autopar.plan(Views(p), (x,), {"dp": 1}, cluster="h100")
        seconds = [(n.op.split(".")[1], n.compute_s) for n in plan.nodes if n.op.startswith("aten.")]
        costly = {op for op, s in seconds if s > 0}
        assert {"view", "transpose"}.isdisjoint(costly) and {"slice", "linear", "add"} <= costly
        assert [s > 0 for op, s in seconds if op == "mul"] == [True, True]  # the product, the in-place one
        assert [s > 0 for op, s in seconds if op == "reshape"] == [True, False]  # the copy, the view
        assert ("dropout" in costly) == dropout_moves
