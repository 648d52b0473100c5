"""Update modes (issue 17): options and their errors, the stale-synchronous clocks, the cost model,
and one multi-process run on real gloo ranks (parameter server and staleness 0 against the
synchronous all-reduce, the staleness bound under a straggler)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.ir.mesh import MeshSpec
from autopar.ir.updates import check_update
from autopar.planning.cost.update_cost import compare_updates, predict_update
from autopar.runtime.param_server import Clocks
from autopar.tools.cli import main as cli_main
from autopar.tools.launch import spawn
from examples import gpt

DP4 = MeshSpec(("dp",), (4,))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_staleness_is_an_int_of_at_least_0(bad: object) -> None:
    with pytest.raises(autopar.OptionError, match=r"Async\(staleness=...\)"):
        autopar.Async(staleness=bad)
    with pytest.raises(autopar.OptionError, match=r"Hybrid\(staleness=...\)"):
        autopar.Hybrid(staleness=bad)


def test_bad_update_options_name_the_option() -> None:
    with pytest.raises(autopar.OptionError, match=r"ParameterServer\(servers=...\)"):
        autopar.ParameterServer(servers=0)
    with pytest.raises(autopar.OptionError, match=r"Hybrid\(groups=3\)"):
        check_update(autopar.Hybrid(groups=3), DP4)
    with pytest.raises(autopar.OptionError, match="no such axis"):
        check_update(autopar.Async(), MeshSpec(("tp",), (4,)))
    with pytest.raises(autopar.OptionError, match="more servers than the job's 4 ranks"):
        check_update(autopar.ParameterServer(servers=5), DP4, world=4)
    with pytest.raises(autopar.OptionError, match="the workers' mesh must hold 3"):
        check_update(autopar.ParameterServer(servers=1), DP4, world=4)
    with pytest.raises(autopar.OptionError, match="pipeline"):
        check_update(autopar.Async(), DP4, pipeline=autopar.Pipeline(4))
    with pytest.raises(autopar.OptionError, match=r"Memory\(zero=1\)"):
        check_update(autopar.Async(), DP4, zero=1)
    with pytest.raises(autopar.OptionError, match="update=..."):
        check_update("async", DP4)
    assert check_update(autopar.Hybrid(groups=2), DP4, world=5).units(4) == 2


def test_staleness_0_applies_one_step_per_clock_over_every_unit() -> None:
    clocks = Clocks(3, 0)
    assert clocks.arrive(1, 0) == [] and clocks.arrive(0, 0) == []
    assert not clocks.may_start(1)
    assert clocks.arrive(2, 0) == [(0, [0, 1, 2])]
    clocks.mark_applied(0, [0, 1, 2])
    assert clocks.may_start(1) and not clocks.may_start(2)
    assert clocks.arrive(0, 1) == [] and clocks.leave(1) == [] and clocks.leave(2) == [(1, [0])]


def test_the_staleness_bound_holds_whatever_the_speeds() -> None:
    """Units of random speeds start clocks only when the clocks allow it: none ever computes on
    parameters missing more than ``bound`` clocks; a dead unit holds nobody back, and rejoins."""
    rng = random.Random(0)
    for bound in (0, 1, 2):
        clocks, next_clock, seen = Clocks(4, bound), [0] * 4, set()
        for tick in range(4000):
            u = rng.choice([0, 0, 1, 2, 3, 3, 3])  # unit 0 fast, unit 3 a straggler... by turns
            if tick == 1500:
                clocks.leave(2)
            if tick == 2500:
                next_clock[2] = clocks.join(2)
            if (u == 2 and 1500 <= tick < 2500) or not clocks.may_start(next_clock[u]):
                continue
            seen.add(clocks.staleness(next_clock[u]))
            for clock, units in clocks.arrive(u, next_clock[u]):
                clocks.mark_applied(clock, units)
            next_clock[u] += 1
        assert max(seen) == bound and min(next_clock) > 100


def _plan() -> autopar.Plan:
    torch.manual_seed(0)
    model, (idx, _) = gpt.build(batch_size=16, device="meta")
    return autopar.plan(model, (idx,), {"dp": 4}, cluster="cpu-gloo")


def test_the_cost_model_prices_a_straggler_under_each_mode() -> None:
    plan = _plan()
    even = predict_update(plan, None, [1, 1, 1, 1], 16)
    assert even.clock_s[0] == pytest.approx(plan.prediction.step_time_s)
    slow = predict_update(plan, None, [1, 1, 1, 3], 16)
    work = plan.prediction.compute_s + plan.prediction.overhead_s
    assert slow.clock_s[0] == pytest.approx(even.clock_s[0] + 2 * work)
    bounded = predict_update(plan, autopar.Async(staleness=2), [1, 1, 1, 3], 16)
    free = predict_update(plan, autopar.Async(staleness=None), [1, 1, 1, 3], 16)
    assert free.samples_per_s >= bounded.samples_per_s and max(free.clock_s) > min(free.clock_s)
    with pytest.raises(autopar.OptionError, match="one slowdown >= 1 per replica"):
        predict_update(plan, None, [1, 3], 16)
    table = compare_updates(plan, [1, 1, 1, 3], 16)
    assert "async, unbounded" in table and "hybrid 2 groups" in table


def test_the_straggler_bench_predicts_the_straggler_it_measures() -> None:
    """bench/stragglers.py's straggler sleeps twice a synchronous step: its prediction must make
    sync a third of the straggler-free pace, as the measurement does."""
    from bench.stragglers import predicted

    rates = predicted("cpu-gloo", 16)
    assert rates["sync"] == pytest.approx(rates["no straggler"] / 3, rel=1e-9)
    assert rates["async, unbounded"] > rates["sync"]


def test_plan_takes_an_update_mode_and_reports_its_step(tmp_path) -> None:
    torch.manual_seed(0)
    model, (idx, _) = gpt.build(batch_size=16, device="meta")
    plan = autopar.plan(model, (idx,), {"dp": 4}, cluster="cpu-gloo", update=autopar.Async(staleness=None))
    sync = _plan()
    assert plan.memory.zero == 0  # the servers hold the optimizer state
    free = predict_update(sync, autopar.Async(staleness=None), [1, 1, 1, 1], 16)
    assert plan.update["mode"] == "async, unbounded"
    assert plan.update["clock_s"] == pytest.approx(max(free.clock_s), rel=1e-6)
    even = predict_update(sync, None, [1, 1, 1, 1], 16)
    assert plan.update["vs_sync"] == pytest.approx(free.samples_per_s / even.samples_per_s, rel=1e-6)
    assert "update: async, unbounded: a unit's clock" in plan.summary()
    plan.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json").update == plan.update
    with pytest.raises(autopar.OptionError, match="plans the workers' mesh you give"):
        autopar.plan(model, (idx,), 4, update=autopar.Async())
    with pytest.raises(autopar.OptionError, match="has no such axis"):
        autopar.plan(model, (idx,), {"tp": 4}, update=autopar.ParameterServer())


def test_autopar_plan_reports_sync_against_async(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "examples/gpt.py:build", "batch_size=16", "--mesh", "dp=4", "--cluster", "cpu-gloo"]
    assert cli_main([*argv, "--stragglers", "1,1,1,3"]) == 0
    assert "update modes, replicas slowed [1.0, 1.0, 1.0, 3.0]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main([*argv, "--stragglers", "1,0.5"])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 128, (8, 32), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _train(update: autopar.ParameterServer | None, mesh: object, steps: int, slow: float = 0.0) -> dict:
    torch.manual_seed(0)
    model, (idx, _) = gpt.build(batch_size=8)
    dmodel = autopar.compile(model, mesh, (idx,), update=update)
    if getattr(dmodel, "is_server", False):
        return {"server_log": dmodel.serve()}
    optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        losses.append(dmodel.train_step((x,), y, gpt.loss_fn).item())
        if dist.get_rank() == 1:
            time.sleep(slow)
        optimizer.step()
        optimizer.zero_grad()
    if update is not None:
        dmodel.close()
    weights = {k: v.full_tensor() for k, v in dmodel.state_dict().items()}
    return {"losses": losses, "weights": weights, "log": getattr(dmodel, "log", [])}


def _checkpointed(mesh: object, folder: str) -> dict[str, dict[int, float]]:
    """Losses of 5 parameter-server steps with the servers checkpointed after the third, then of a
    job resumed from that checkpoint (from a model initialised otherwise: the servers' state counts)."""
    update, found = autopar.ParameterServer(), {}
    for phase, seed in (("whole", 0), ("resumed", 1)):
        torch.manual_seed(seed)
        model, (idx, _) = gpt.build(batch_size=8)
        dmodel = autopar.compile(model, mesh, (idx,), update=update)
        if dmodel.is_server:
            dmodel.serve(resume=folder if phase == "resumed" else None)
            continue
        optimizer = dmodel.optimizer(torch.optim.AdamW, lr=1e-2)
        losses = found.setdefault(phase, {})
        for step in range(dmodel.clock, 5):
            x, y = _batch(step)
            losses[step] = dmodel.train_step((x,), y, gpt.loss_fn).item()
            optimizer.step()
            optimizer.zero_grad()
            if phase == "whole" and step == 2:
                dmodel.save_checkpoint(folder)
        dmodel.close()
    return found


def _modes(folder: str) -> dict:
    """On 3 ranks: sync on the 2 workers, then the parameter server, staleness 0, staleness 1, and a
    checkpoint of the servers resumed."""
    mesh = autopar.worker_mesh(autopar.ParameterServer(), {"dp": 2})
    found = {"sync": _train(None, mesh, 3) if dist.get_rank() < 2 else {}}
    found["ps"] = _train(autopar.ParameterServer(), mesh, 3)
    found["s0"] = _train(autopar.Async(staleness=0), mesh, 3)
    found["s1"] = _train(autopar.Async(staleness=1), mesh, 8, slow=0.15)
    found["resume"] = _checkpointed(mesh, folder)
    return found


@pytest.mark.distributed
def test_parameter_server_and_staleness_0_are_synchronous_and_the_bound_holds(tmp_path: Path) -> None:
    ranks = spawn(_modes, 3, str(tmp_path))
    torch.manual_seed(0)
    model, _ = gpt.build(batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alone = []
    for step in range(3):
        x, y = _batch(step)
        loss = gpt.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        alone.append(loss.item())
    sync = ranks[0]["sync"]
    torch.testing.assert_close(sync["losses"], alone, rtol=1e-5, atol=1e-6)
    for mode in ("ps", "s0"):
        # each unit's loss is the mean over its half of the batch: their mean is the batch's
        mean = [(a + b) / 2 for a, b in zip(ranks[0][mode]["losses"], ranks[1][mode]["losses"])]
        torch.testing.assert_close(mean, sync["losses"], rtol=1e-6, atol=1e-6)
        for name, w in sync["weights"].items():
            torch.testing.assert_close(ranks[0][mode]["weights"][name], w, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ranks[1][mode]["weights"][name], w, rtol=1e-4, atol=1e-4)
        assert {entry[2] for r in ranks[:2] for entry in r[mode]["log"]} == {0}
    # staleness 1 with worker 1 slow: worker 0 runs one clock ahead, never two
    stale = [entry[2] for entry in ranks[0]["s1"]["log"]]
    assert max(stale) == 1
    server = ranks[2]["s1"]["server_log"]
    assert all(e[3] <= 1 for e in server if e[0] == "start")
    assert sum(1 for e in server if e[0] == "apply") == 16  # one optimizer step per push
    # the servers' checkpoint: a job resumed from it starts at clock 3 and runs as the whole one did
    for worker in ranks[:2]:
        whole, resumed = worker["resume"]["whole"], worker["resume"]["resumed"]
        assert sorted(resumed) == [3, 4]
        torch.testing.assert_close([resumed[3], resumed[4]], [whole[3], whole[4]], rtol=1e-6, atol=1e-6)
