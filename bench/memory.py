"""Memory plans: Llama-2-7B planning targets, and predicted against measured memory on gloo ranks.

Usage, from the repository root::

    python bench/memory.py plan [--layers 32] [--mesh dp=8] [--budgets none,40e9,1e9]
    python bench/memory.py measure [--ranks 4] [--json out.json]

``plan``: transformers' ``LlamaForCausalLM`` with Llama-2-7B's shape (32 layers, hidden 4096,
32 heads, FFN 11008, vocabulary 32000) in bf16 on ``meta``, a global batch of 8 sequences of
4096 tokens, planned for 8 devices of the ``h100`` cluster model (80 GB each) under each
budget (``none``: the device memory) with AdamW's two fp32 states per parameter. Prints, per
budget, what the planner chose (ZeRO stage, recompute), the per-device breakdown and the
predicted step, or the error naming the least memory any plan reaches.

``measure``: spawns ``--ranks`` gloo processes; for each memory plan of the example GPT
(ZeRO 0-3, recompute none / selective / full, offload) it runs three AdamW steps and
compares, per rank, the bytes of parameters + gradients + optimizer state held after a
step (``DistributedModule.state_bytes``) with the plan's prediction, and the peak
activation memory (``autopar.tools.activation_meter.ActivationMeter``) with the predicted peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the ranks import examples/

import autopar  # noqa: E402

GB = 1e9
MEASURED = [  # (mesh, annotation style, Memory options, recompute policy of every block)
    ({"dp": 4}, "dp", {"zero": 0}, None),
    ({"dp": 4}, "dp", {"zero": 1}, None),
    ({"dp": 4}, "dp", {"zero": 2}, None),
    ({"dp": 4}, "dp", {"zero": 3}, None),
    ({"dp": 4}, "dp", {"zero": 0}, "selective"),
    ({"dp": 4}, "dp", {"zero": 0}, "full"),
    ({"dp": 2, "tp": 2}, "dp-tp", {"zero": 0}, None),
    ({"dp": 2, "tp": 2}, "dp-tp", {"zero": 2}, "selective"),
    ({"dp": 2, "tp": 2}, "dp-tp", {"zero": 0}, "full"),
    ({"dp": 4}, "dp", {"zero": 1, "offload_optimizer": True, "offload_activations": True}, None),
]


def plan_llama(layers: int, mesh: dict[str, int], budgets: list[float | None]) -> list[dict[str, Any]]:
    from plan_scale import llama  # this directory is on sys.path when run as a script

    model = llama("llama-2-7b", layers, torch.bfloat16)
    ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    rows = []
    for budget in budgets:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"budget_GB": None if budget is None else budget / GB}
        try:
            plan = autopar.plan(
                model,
                (),
                mesh,
                example_kwargs={"input_ids": ids, "labels": ids},
                cluster="h100",
                memory_budget=budget,
            )
        except autopar.PlanError as exc:
            row.update(error=str(exc), wall_s=round(time.perf_counter() - t0, 1))
            rows.append(row)
            continue
        p, m = plan.prediction, plan.memory
        row.update(
            wall_s=round(time.perf_counter() - t0, 1),
            zero=m.zero,
            recompute=sorted(set(m.recompute.values())) or None,
            chosen=m.chosen,
            param_GB=p.param_bytes / GB,
            grad_GB=p.grad_bytes / GB,
            optimizer_GB=p.optimizer_bytes / GB,
            activation_GB=p.activation_bytes / GB,
            total_GB=p.memory_bytes / GB,
            step_s=p.step_time_s,
        )
        rows.append(row)
    return rows


def _measure_case(mesh_shape: dict[str, int], style: str, options: dict, recompute: str | None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.tools.activation_meter import ActivationMeter
    from examples import gpt

    torch.manual_seed(0)
    model, args = gpt.build(batch_size=8, n_layers=2)
    gpt.annotate(model, style)
    if recompute:
        for block in model.blocks:
            autopar.recompute(block, recompute)
    mesh = init_device_mesh("cpu", tuple(mesh_shape.values()), mesh_dim_names=tuple(mesh_shape))
    dmodel = autopar.compile(model, mesh, args, memory=autopar.Memory(**options), cluster="fast-links")
    opt = dmodel.optimizer(torch.optim.AdamW, lr=1e-3)
    peak = 0
    for step in range(3):
        torch.manual_seed(step)
        batch = dmodel.shard_inputs(*(torch.randint_like(a, 0, 128) for a in args))[0]
        with ActivationMeter() as meter:
            dmodel(*batch).backward()
        peak = max(peak, meter.peak)
        opt.step()
        held = dmodel.state_bytes(opt)
        opt.zero_grad()
    p, m = dmodel.plan.prediction, dmodel.plan.memory
    return {
        "mesh": mesh_shape,
        "memory": options,
        "recompute": recompute,
        "state_measured": held,
        "state_predicted": {
            "param": p.param_bytes,
            "grad": p.grad_bytes,
            "optimizer": p.optimizer_bytes,
            "host": m.host_optimizer_bytes,
        },
        "activation_peak_measured": peak,
        "activation_peak_predicted": p.activation_bytes,
    }


def _measure_world(cases: list[tuple]) -> list[dict]:
    return [_measure_case(*c) for c in cases]


def _print_plan(rows: list[dict]) -> None:
    print("| budget | chose | parameters | gradients | optimizer | activations | total | step | plan wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        budget = "device (80 GB)" if r["budget_GB"] is None else f"{r['budget_GB']:g} GB"
        if "error" in r:
            print(f"| {budget} | error: {r['error']} | | | | | | | {r['wall_s']} s |")
            continue
        chose = f"ZeRO-{r['zero']}" + (f", {'/'.join(r['recompute'])} recompute" if r["recompute"] else "")
        sizes = " | ".join(f"{r[k]:.2f} GB" for k in ("param_GB", "grad_GB", "optimizer_GB", "activation_GB"))
        total = f"{r['total_GB']:.2f} GB"
        print(f"| {budget} | {chose} | {sizes} | {total} | {r['step_s']:.3f} s | {r['wall_s']} s |")


def _print_measured(rank0: list[dict]) -> None:
    print("| mesh | memory | recompute | state measured = predicted | activation peak measured / predicted |")
    print("| --- | --- | --- | --- | --- |")
    for r in rank0:
        state = sum(r["state_measured"].values())
        same = "yes" if r["state_measured"] == r["state_predicted"] else f"NO {r['state_predicted']}"
        ratio = r["activation_peak_measured"] / r["activation_peak_predicted"]
        mesh = "×".join(f"{k}={v}" for k, v in r["mesh"].items())
        print(
            f"| {mesh} | {r['memory']} | {r['recompute'] or '-'} | {state / 1e6:.3f} MB: {same} "
            f"| {r['activation_peak_measured'] / 1e6:.3f} / {r['activation_peak_predicted'] / 1e6:.3f} MB "
            f"({ratio:.3f}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan")
    plan.add_argument("--layers", type=int, default=32)
    plan.add_argument("--mesh", default="dp=8")
    plan.add_argument("--budgets", default="none,40e9,1e9")
    measure = sub.add_parser("measure")
    measure.add_argument("--ranks", type=int, default=4)
    for p in (plan, measure):
        p.add_argument("--json", help="write the results here too")
    a = parser.parse_args()
    if a.command == "plan":
        mesh = {k: int(v) for k, v in (item.split("=") for item in a.mesh.split(","))}
        budgets = [None if b == "none" else float(b) for b in a.budgets.split(",")]
        results: Any = plan_llama(a.layers, mesh, budgets)
        _print_plan(results)
    else:
        from autopar.tools.launch import spawn

        results = spawn(_measure_world, a.ranks, MEASURED)
        _print_measured(results[0])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": a.command, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
