"""Pipeline planning and compiling without ranks: stages, the partition, schedules' memory, errors.

Training on real gloo ranks is in ``test_distributed.py``; here plans are made for
``{axis: size}`` meshes and modules are compiled on torch's fake process group.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.ir.options import Pipeline
from autopar.planning.pipeline.stage_split import UnitCosts, partition
from examples import gpt

MESH = {"pp": 2, "dp": 2, "tp": 2}


def _gpt(n_layers: int = 4, batch_size: int = 8, **overrides):
    return gpt.build(batch_size=batch_size, n_layers=n_layers, device="meta", **overrides)


def _annotate_stages(model, stages_of_blocks: list[int]) -> None:
    for block, k in zip(model.blocks, stages_of_blocks):
        autopar.pipeline_stage(block, k)
    for module in (model.wte, model.wpe):
        autopar.pipeline_stage(module, stages_of_blocks[0])
    for module in (model.ln_f, model.lm_head):
        autopar.pipeline_stage(module, stages_of_blocks[-1])


# --------------------------------------------------------------------------- options and errors


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"microbatches": 0}, r"Pipeline\(microbatches=...\) must be an int >= 1"),
        ({"microbatches": 4, "schedule": "zb"}, "unknown schedule 'zb'"),
        ({"microbatches": 4, "schedule": "interleaved-1f1b"}, "needs virtual_stages >= 2"),
        ({"microbatches": 4, "virtual_stages": 2}, "needs schedule='interleaved-1f1b'"),
    ],
)
def test_pipeline_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(**kwargs)


@pytest.mark.parametrize(
    "mesh,pipeline,batch,message",
    [
        ({"pp": 4, "dp": 2}, Pipeline(2), 8, "'1f1b' needs at least as many microbatches as stages: 2 micro"),
        (MESH, Pipeline(4), 6, r"input args\[0\] has batch 6 along dim 0, which cannot be cut into 4"),
        ({"dp": 2, "tp": 2}, Pipeline(4), 8, "pipeline axis 'pp' is not an axis of mesh dp=2×tp=2"),
        ({"dp": 2, "pp": 2}, Pipeline(4), 8, "must be the first"),
        ({"pp": 4}, Pipeline(4), 8, "has only the pipeline axis"),
        (MESH, None, 8, "has an axis named 'pp', the pipeline axis"),
        ({"pp": 3, "dp": 1}, Pipeline(7, "interleaved-1f1b", 2), 14, "7 microbatches is not a multiple"),
    ],
)
def test_bad_pipelines_get_clear_errors(mesh, pipeline, batch, message):
    model, args = _gpt(batch_size=batch)
    with pytest.raises(autopar.PlanError, match=message):
        autopar.plan(model, args, mesh, pipeline=pipeline)


def test_annotated_stages_must_match_the_pipeline_and_the_forward():
    model, args = _gpt()
    _annotate_stages(model, [0, 0, 1, 2])
    with pytest.raises(autopar.AnnotationError, match=r"give 3 stages, but pipeline axis pp=2 .* runs 2"):
        autopar.plan(model, args, MESH, pipeline=Pipeline(4))

    model, args = _gpt()
    _annotate_stages(model, [1, 1, 0, 0])
    with pytest.raises(autopar.AnnotationError, match="must follow the order of the forward"):
        autopar.plan(model, args, MESH, pipeline=Pipeline(4))

    model, args = _gpt()
    for i, block in enumerate(model.blocks):
        autopar.pipeline_stage(block, i // 2)
    with pytest.raises(autopar.AnnotationError, match="parameter 'wte.weight' belongs to module 'wte', wh"):
        autopar.plan(model, args, MESH, pipeline=Pipeline(4))


def test_weights_tied_across_stages_are_refused_by_name():
    model, args = _gpt(tied_embeddings=True)
    with pytest.raises(autopar.AnnotationError) as e:
        autopar.plan(model, args, MESH, pipeline=Pipeline(4))
    assert "parameter 'wte.weight' = 'lm_head.weight' is used in pipeline stages [0, 1]" in str(e.value)
    assert "module 'lm_head'" in str(e.value) and "module 'wte'" in str(e.value)


def test_more_stages_than_units_is_an_error():
    model, args = _gpt(n_layers=1)
    with pytest.raises(autopar.PlanError, match=r"the model has \d+ pipeline units .* for 16 stages"):
        autopar.plan(model, args, {"pp": 8, "dp": 1}, pipeline=Pipeline(8, "interleaved-1f1b", 2))


# --------------------------------------------------------------------------- plans


def test_automatic_stages_balance_the_blocks_and_survive_json(tmp_path):
    # big enough that compute, not the latency of sending activations, decides the split
    model, args = _gpt(n_layers=8, d_model=1024, n_heads=16, d_ff=4096, seq_len=512)
    plan = autopar.plan(model, args, {"pp": 4, "dp": 2}, pipeline=Pipeline(8), cluster="h100")
    pp = plan.pipeline
    assert pp.automatic and [s.rank for s in pp.stages] == [0, 1, 2, 3]
    blocks = [sum(m.startswith("blocks.") for m in s.modules) for s in pp.stages]
    assert sum(blocks) == 8 and max(blocks) - min(blocks) <= 1, [s.modules for s in pp.stages]
    assert pp.stages[0].modules[0] == "<root>" and pp.stages[-1].modules[-1] == "<root>"  # the loss
    assert pp.bubble_fraction == pytest.approx(3 / 11)
    # 1F1B: stage s holds p - s microbatches' activations at most
    assert [s.in_flight for s in pp.stages] == [4, 3, 2, 1]
    assert plan.mesh == {"dp": 2} and plan.device_mesh_spec.to_dict() == {"pp": 4, "dp": 2}
    summary = plan.summary()
    assert "pipeline over pp=4: 4 stages (chosen by the planner), schedule 1f1b, 8 microbatches" in summary
    plan.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json").pipeline == pp


def test_annotated_stages_are_honoured_exactly():
    model, args = _gpt()
    _annotate_stages(model, [0, 0, 0, 1])
    plan = autopar.plan(model, args, MESH, pipeline=Pipeline(4, "gpipe"))
    pp = plan.pipeline
    assert not pp.automatic
    assert pp.stages[0].modules[-1] == "blocks.2" and pp.stages[1].modules[0] == "blocks.3"
    assert [s.in_flight for s in pp.stages] == [4, 4]  # GPipe keeps every microbatch
    stage_of = pp.node_stages
    assert stage_of["arange"] == 0  # floats to its first user, wpe
    assert stage_of["amax"] == 1  # root op after lm_head (the loss's)
    assert stage_of["targets"] == 0  # inputs enter at the first stage and are carried


def _brute_force(costs: UnitCosts, pipeline: Pipeline, p: int, memory: float):
    n, stages, m = len(costs.seconds), p * pipeline.virtual_stages, pipeline.microbatches
    cut = [*costs.cut_seconds, 0.0]
    best = None
    for inner in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *inner, n]
        times, ok = [], True
        for s, (i, j) in enumerate(itertools.pairwise(bounds)):
            times.append(sum(costs.seconds[i:j]) + (cut[i] if i else 0.0) + cut[j])
            flight = pipeline.in_flight(p, s % p) / pipeline.virtual_stages
            ok &= sum(costs.fixed_bytes[i:j]) + flight * sum(costs.activation_bytes[i:j]) <= memory
        if ok:
            objective = sum(times) + (m - 1) * max(times)
            best = objective if best is None else min(best, objective)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_partition_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    costs = UnitCosts(
        [rng.uniform(0.1, 1.0) for _ in range(n)],
        [rng.uniform(0, 10) for _ in range(n)],
        [rng.uniform(0, 5) for _ in range(n)],
        [rng.uniform(0, 0.3) for _ in range(n)],
    )
    pipeline = Pipeline(rng.choice([2, 4, 8]), rng.choice(["gpipe", "1f1b"]))
    memory = rng.uniform(30, 80)
    best = _brute_force(costs, pipeline, 2, memory)
    # what check_stage_memory asks before assembling a plan: a split by memory alone
    by_memory = UnitCosts([0.0] * n, costs.fixed_bytes, costs.activation_bytes, [0.0] * n)
    if best is None:
        for asked in (costs, by_memory):
            with pytest.raises(autopar.PlanError, match="no split of the model into 2 pipeline stages fits"):
                partition(asked, pipeline, 2, memory)
        return
    partition(by_memory, pipeline, 2, memory)
    stage = partition(costs, pipeline, 2, memory)
    bounds = [0, stage.index(1), n]
    cut = [*costs.cut_seconds, 0.0]
    times = [sum(costs.seconds[i:j]) + (cut[i] if i else 0.0) + cut[j] for i, j in itertools.pairwise(bounds)]
    assert sum(times) + (pipeline.microbatches - 1) * max(times) == pytest.approx(best)


@pytest.mark.parametrize(
    "schedule,p,v,m",
    [
        ("gpipe", 4, 1, 8),
        ("1f1b", 4, 1, 4),
        ("1f1b", 4, 1, 10),
        ("interleaved-1f1b", 4, 2, 4),
        ("interleaved-1f1b", 4, 2, 8),
        ("interleaved-1f1b", 4, 3, 12),
    ],
)
def test_microbatches_in_flight_match_torchs_schedules(fake_process_group, schedule, p, v, m):
    """The memory model's in-flight counts against the action lists torch's schedules run."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    x = torch.empty(2, 2)
    stages = [
        PipelineStage(torch.nn.Identity(), s, p * v, torch.device("cpu"), input_args=(x,), output_args=(x,))
        for s in range(0, p * v, p)
    ]
    if schedule == "interleaved-1f1b":
        order = ScheduleInterleaved1F1B(stages, m, loss_fn=torch.sum).pipeline_order
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        order = cls(stages[0], m, loss_fn=torch.sum)._get_pipeline_order()
    pipeline = Pipeline(m, schedule, v)
    for rank in range(p):
        held = peak = 0
        for action in order[rank]:
            kind = str(getattr(action, "computation_type", ""))
            held += 1 if kind.endswith("FORWARD") and "BACKWARD" not in kind else 0
            held -= 1 if "BACKWARD" in kind else 0
            peak = max(peak, held)
        assert peak == pipeline.in_flight(p, rank), (rank, order[rank])


# --------------------------------------------------------------------------- compiling


@pytest.fixture
def world_of_8():
    """A fake process group of 8 ranks, this process rank 0 (pipeline coordinate 0)."""
    from autopar.tools.fake_ranks import fake_world

    with fake_world(8):
        yield


def test_a_pipelined_module_holds_its_stage_and_prints_each_program(world_of_8):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    model, args = gpt.build(batch_size=8, n_layers=4)
    gpt.annotate(model, "tp")
    dmodel = autopar.compile(model, mesh, args, pipeline=Pipeline(4), cluster="fast-links")
    stages = dmodel.plan.pipeline.stages
    held = {name for name, _ in dmodel.named_parameters()}
    first = {n for n, p in model.named_parameters() if dmodel.plan.pipeline.node_stages[_placeholder(n)] == 0}
    assert held == first and "wte.weight" in held and "lm_head.weight" not in held
    assert set(dmodel.state_dict()) == first  # other stages' weights live on other ranks
    fc = dmodel.get_parameter("blocks.0.mlp.fc.weight")
    assert isinstance(fc, DTensor) and fc.device_mesh.mesh_dim_names == ("dp", "tp")
    (program,) = dmodel.pipeline.programs
    assert program.index == 0 and [b.name for b in program.received] == ["idx", "targets"]
    assert "targets" in [b.name for b in program.sent]  # carried to the loss in the last stage
    code = program.code
    assert code.startswith("# Constructed by split_stages: stage 0\ndef forward(idx, targets, ")
    assert "autopar.all_reduce(" in code  # Megatron's row-parallel sums run inside the stage
    assert len(stages) == 2 and "split_stages" in dmodel.pass_snapshots
    with pytest.raises(autopar.CompileError, match="train_step"):
        dmodel(*args)
    idx, targets = args  # the model computes its loss from the targets
    with pytest.raises(autopar.ShapeError, match="a target but no loss_fn"):
        dmodel.train_step(args, targets)
    with pytest.raises(autopar.ShapeError, match=r"input 'idx' has shape \(6, 32\), but .* 4 microbatches"):
        dmodel.train_step((idx[:6], targets[:6]))


def _placeholder(fqn: str) -> str:
    return "p_" + fqn.replace(".", "_")


def test_a_pipelined_llama_carries_its_rotary_tables_and_mask(world_of_8):
    """transformers' Llama builds its rotary tables in a no-grad region (a submodule the stage
    program must refer to) and every layer reads them and the mask: they travel through stages."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (8, 16))
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    dmodel = autopar.compile(
        model, mesh, (), example_kwargs={"input_ids": ids, "labels": ids}, pipeline=Pipeline(4, "gpipe")
    )
    (program,) = dmodel.pipeline.programs
    sent = [b for b in program.sent if b.dtype.is_floating_point and not b.requires_grad]
    assert len(sent) >= 2  # the cos and sin tables, computed once in stage 0
    assert "labels" in [b.name for b in program.sent]


class _TablesInNoGrad(torch.nn.Module):
    """Rotary-style tables built under torch.no_grad() in forward and read by every layer:
    torch.export keeps such a region as a submodule the stage program must carry."""

    def __init__(self, width: int = 16, n_layers: int = 4) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(width))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            positions = torch.arange(x.shape[1], dtype=x.dtype).unsqueeze(-1)
            table = torch.cos(positions * self.inv_freq)
        for layer in self.layers:
            x = torch.relu(layer(x)) * table
        return x.sum()


def test_a_no_grad_region_travels_into_the_stage_that_runs_it(world_of_8):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    dmodel = autopar.compile(_TablesInNoGrad(), mesh, (torch.randn(8, 6, 16),), pipeline=Pipeline(4, "gpipe"))
    (program,) = dmodel.pipeline.programs
    assert "submod" in program.code  # the no-grad region, held by stage 0's program
    tables = [b for b in program.sent if b.dtype.is_floating_point and not b.requires_grad]
    assert [b.shape for b in tables] == [(6, 16)]  # computed once, sent to the next stage
