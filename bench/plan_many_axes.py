"""Planning time on meshes of many axes: the planner must stay within ``time_limit`` on any mesh.

Plans the example GPT (``examples/gpt.py``'s tiny defaults) on meshes of 2 to 6 axes of size 2,
and a Llama-2-7B shape (``bench/plan_scale.py``) on 64 ranks as 2, 4 and 6 axes, all with
``time_limit=30`` on the ``h100`` cluster model, and prints per case the wall time (capture
included), the axes the planner merged to stay within the limit (``autopar.planning.graph.axis_groups``),
the ILP's size, the solver's status and gap, and the predicted step time.

    python bench/plan_many_axes.py                 # every case
    python bench/plan_many_axes.py --only gpt      # the example GPT only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# the repository's root, for `examples` and `bench` when this runs as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from bench.plan_scale import llama  # noqa: E402
from examples import gpt  # noqa: E402

TIME_LIMIT = 30.0
LLAMA_MESHES = [
    {"dp": 8, "tp": 8},
    {"dp": 4, "cp": 2, "tp": 4, "ep": 2},
    {f"a{i}": 2 for i in range(6)},
]


def _case(name: str, model: torch.nn.Module, args: tuple, kwargs: dict | None, mesh: dict) -> dict:
    t0 = time.perf_counter()
    plan = autopar.plan(model, args, mesh, example_kwargs=kwargs, cluster="h100", time_limit=TIME_LIMIT)
    wall = time.perf_counter() - t0
    s = plan.solver
    merged = [w.split(": ", 1)[1].split(" (")[0] for w in plan.warnings if "planned together" in w]
    return {
        "model": name,
        "mesh": "x".join(f"{k}={v}" for k, v in mesh.items()),
        "wall_s": round(wall, 1),
        "merged": merged[0] if merged else "-",
        "variables": s.variables,
        "status": s.status,
        "gap": round(s.gap, 3),
        "step_ms": round(plan.prediction.step_time_s * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["gpt", "llama"])
    a = parser.parse_args()
    if a.only != "llama":
        for n in range(2, 7):
            model, args = gpt.build(device="meta")
            print(json.dumps(_case("gpt", model, args, None, {f"a{i}": 2 for i in range(n)})), flush=True)
    if a.only != "gpt":
        ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
        for mesh in LLAMA_MESHES:
            kwargs = {"input_ids": ids, "labels": ids}
            print(json.dumps(_case("llama-2-7b", llama("llama-2-7b"), (), kwargs, mesh)), flush=True)


if __name__ == "__main__":
    main()
