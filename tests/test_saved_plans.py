"""Plans saved by an earlier autopar still load and lower to the programs they lowered to then.

``tests/data/saved_plans/<case>.json`` are plans the code of commit 217d1df (plan format 4) saved,
and ``<case>.program.txt`` the per-rank programs it lowered them to on rank 0 (each pass's graph,
``PassContext.snapshots``, by its digest, then the final program; under a pipeline, each stage's). Both were
written by this file's ``write_saved_plans`` run on that commit's tree. Each case is lowered
again here from the saved plan and must give the same text byte for byte. (Planning the cases
afresh decided what the saved plans did until issue 44 changed the cost model on purpose: each
parameter's optimizer step priced in its layout, gradient sums of parameters' casts deferred to
their buckets, launches as a floor; a saved plan is a contract, and lowering it is what must not
change.)
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler import lower
from autopar.ir.mesh import MeshSpec
from autopar.ir.options import Memory, Pipeline
from autopar.ir.plan import Plan, load_plan
from autopar.planning.planner import capture_for, layout_mesh
from autopar.tools.fake_ranks import fake_world

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from zoo_models import build  # noqa: E402

from examples.gpt import GPT, GPTConfig  # noqa: E402

DATA = Path(__file__).parent / "data" / "saved_plans"
SMALL = GPTConfig(vocab_size=128, seq_len=16, d_model=64, n_heads=4, n_layers=2, d_ff=256)


def _gpt(recompute: bool = False) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model = GPT(SMALL)
    if recompute:
        autopar.recompute(model.blocks[0], "selective")
        autopar.recompute(model.blocks[1])
    return model, (torch.randint(0, SMALL.vocab_size, (8, SMALL.seq_len)),), {}


def _zoo(name: str) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model, args, kwargs = build(name)
    return model, tuple(args), dict(kwargs or {})


# case -> (model builder, mesh, plan keywords)
CASES: dict[str, tuple[Any, dict[str, int], dict[str, Any]]] = {
    "gpt_dp_tp": (_gpt, {"dp": 2, "tp": 2}, {}),
    "gpt_zero3_recompute": (
        lambda: _gpt(recompute=True),
        {"dp": 4},
        {"memory": Memory(zero=3)},
    ),
    "gpt_pipeline": (_gpt, {"pp": 2, "dp": 2}, {"pipeline": Pipeline(microbatches=4)}),
    "gpt2_three_axes": (lambda: _zoo("gpt2"), {"dp": 2, "sp": 2, "tp": 2}, {}),
    "llama_dp_tp": (lambda: _zoo("llama"), {"dp": 2, "tp": 2}, {}),
}
PLAN_OPTIONS = {"cluster": "fast-links", "time_limit": 20.0, "seed": 0}


def _plan(case: str) -> Plan:
    make, mesh, keywords = CASES[case]
    model, args, kwargs = make()
    return autopar.plan(model, args, mesh, example_kwargs=kwargs, **PLAN_OPTIONS, **keywords)


def programs(case: str, plan: Plan) -> str:
    """Rank 0's program after every pass of lowering ``plan``, as ``compile`` captures and lowers it."""
    make, mesh, _ = CASES[case]
    model, args, kwargs = make()
    spec = MeshSpec.of(mesh)
    pipeline = None
    if plan.pipeline is not None:
        saved = plan.pipeline
        pipeline = Pipeline(saved.microbatches, saved.schedule, saved.virtual_stages, saved.axis)
    captured = capture_for(model, args, kwargs, spec, pipeline, None, stack_traces=True)
    with fake_world(math.prod(mesh.values())):
        device_mesh = init_device_mesh("cpu", spec.axis_sizes, mesh_dim_names=spec.axis_names)
        stage_names = layout_mesh(spec, pipeline).axis_names
        stage_mesh = device_mesh if pipeline is None else device_mesh[stage_names]
        gm, ctx = lower(captured, plan, stage_mesh)
    # each pass's graph by its digest (the files stay small), the final programs whole
    texts = [
        f"# after {name}: sha256 {hashlib.sha256(text.encode()).hexdigest()}"
        for name, text in ctx.snapshots.items()
    ]
    texts.append(f"# final program\n{gm.code}")
    for i, stage in enumerate(ctx.stages or ()):
        texts.append(f"# stage {i}\n{stage.program.code}")
    return "\n".join(texts)


def write_saved_plans() -> None:
    """Write every case's plan and programs (run on the tree whose plans the test keeps)."""
    DATA.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        plan = _plan(case)
        plan.save(str(DATA / f"{case}.json"))
        (DATA / f"{case}.program.txt").write_text(programs(case, plan))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_saved_plan_lowers_to_the_program_it_lowered_to(case: str):
    saved = load_plan(str(DATA / f"{case}.json"))
    expected = (DATA / f"{case}.program.txt").read_text()
    assert programs(case, saved) == expected


if __name__ == "__main__":
    write_saved_plans()
