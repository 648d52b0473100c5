"""Bad inputs a new user gives the loss scaler, the step meter and the update modes: each is an
``autopar.AutoparError`` naming what was given and what was expected, or, for a numpy number, the
Python number it equals (a count from numpy is a count; a float, a bool or a tensor is not one).

Everything runs in this process: the meter on a world of one fake rank, the parameter server's
state without any rank.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import autopar
from autopar.runtime import param_server
from autopar.runtime.async_updates import UpdatedModule
from autopar.runtime.loss_scaler import MIN_SCALE
from autopar.tools.fake_ranks import fake_world
from autopar.tools.telemetry import StepMeter


class _Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)).sum()


@pytest.fixture(scope="module")
def compiled() -> Iterator[tuple[Any, torch.optim.Optimizer]]:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        dmodel = autopar.compile(_Sum(), mesh, (torch.randn(4, 8),))
        yield dmodel, dmodel.optimizer(torch.optim.SGD, lr=0.1)


def _backward(dmodel: Any, scaler: autopar.LossScaler) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    scaler.scale(dmodel(*dmodel.shard_inputs(x)[0])).backward()


# --- the loss scaler ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (1.5, "LossScaler.scale\\(loss\\) takes the loss tensor to call backward\\(\\) on, got float 1.5"),
        (None, "takes the loss tensor to call backward\\(\\) on, got NoneType None"),
        (np.float32(1.0), "got float32 np.float32\\(1.0\\)"),
        ("loss", "got str 'loss'"),
        (
            torch.ones(3),
            "a floating-point tensor of one element, got a torch.float32 tensor of shape \\(3,\\)",
        ),
        (torch.tensor(3), "got a torch.int64 tensor of shape \\(\\): reduce it first"),
    ],
)
def test_scale_takes_a_floating_loss_of_one_element(loss: object, message: str) -> None:
    with pytest.raises(autopar.OptionError, match=message):
        autopar.LossScaler().scale(loss)


def test_scales_below_float32s_smallest_normal_are_refused_and_backing_off_stops_there(compiled) -> None:
    for bad in (1e-45, 5e-324):
        with pytest.raises(autopar.OptionError, match="init_scale=...\\) must be at least 1.175e-38"):
            autopar.LossScaler(init_scale=bad)
    with pytest.raises(autopar.OptionError, match="'scale' must be at least 1.175e-38"):
        autopar.LossScaler().load_state_dict({"scale": 1e-40, "good_steps": 0, "skipped_steps": 0})
    dmodel, optimizer = compiled
    scaler = autopar.LossScaler(init_scale=MIN_SCALE, backoff_factor=1e-300)
    _backward(dmodel, scaler)
    for p in dmodel.parameters():  # an overflow: the scale backs off, but not to 0
        p.grad.to_local()[0] = float("nan")
    assert not scaler.step(optimizer)
    scaler.update()
    assert scaler.scale_value == MIN_SCALE and scaler.skipped_steps == 1


def test_a_second_step_before_update_is_refused(compiled) -> None:
    dmodel, optimizer = compiled
    scaler = autopar.LossScaler(init_scale=4.0)
    _backward(dmodel, scaler)
    before = [p.detach().to_local().clone() for p in dmodel.parameters()]
    assert scaler.step(optimizer)
    after = [p.detach().to_local().clone() for p in dmodel.parameters()]
    with pytest.raises(
        autopar.OptionError, match="LossScaler.step\\(optimizer\\) was called twice in one step"
    ):
        scaler.step(optimizer)
    assert all(torch.equal(a, p.detach().to_local()) for a, p in zip(after, dmodel.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(before, after))
    scaler.update()
    optimizer.zero_grad()
    _backward(dmodel, scaler)
    assert scaler.step(optimizer)  # the next step steps again
    scaler.update()
    optimizer.zero_grad()


def test_numpy_numbers_are_the_python_numbers_they_equal() -> None:
    scaler = autopar.LossScaler(np.int64(1024), np.float32(4.0), np.float64(0.25), np.int64(10))
    assert (scaler.scale_value, scaler.growth_factor, scaler.backoff_factor) == (1024.0, 4.0, 0.25)
    assert scaler.growth_interval == 10 and type(scaler.growth_interval) is int
    scaler.load_state_dict(
        {"scale": np.float32(8.0), "good_steps": np.int32(3), "skipped_steps": np.int64(1)}
    )
    assert scaler.state_dict() == {"scale": 8.0, "good_steps": 3, "skipped_steps": 1}
    assert all(type(v) in (int, float) for v in scaler.state_dict().values())
    with pytest.raises(autopar.OptionError, match="growth_interval=...\\) must be an int >= 1, got 10.0"):
        autopar.LossScaler(growth_interval=np.float64(10.0))
    with pytest.raises(autopar.OptionError, match="growth_interval=...\\) must be an int >= 1, got np.True_"):
        autopar.LossScaler(growth_interval=np.True_)
    with pytest.raises(autopar.OptionError, match="init_scale=...\\) must be a number above 0, got tensor"):
        autopar.LossScaler(torch.tensor(1024.0))
    update = autopar.Hybrid(servers=np.int64(2), groups=np.int32(2), staleness=np.int16(1))
    assert update == autopar.Hybrid(servers=2, groups=2, staleness=1)
    assert all(type(v) is int for v in (update.servers, update.groups, update.staleness))
    for bad, what in (
        (np.float64(2.0), "servers"),
        (torch.tensor(2), "staleness"),
        (np.float32(1.0), "groups"),
    ):
        with pytest.raises(autopar.OptionError, match=f"Hybrid\\({what}=...\\)"):
            autopar.Hybrid(**{what: bad})


# --- the step meter -----------------------------------------------------------------------------
def test_step_meter_paths_and_counts(compiled, tmp_path: Path) -> None:
    dmodel, optimizer = compiled
    cases = [
        ({"jsonl": ""}, "StepMeter\\(jsonl=''\\) names no file"),
        (
            {"jsonl": "~/steps.jsonl"},
            "StepMeter\\(jsonl='~/steps.jsonl'\\) begins with '~', which Python does",
        ),
        ({"jsonl": "a\0b.jsonl"}, "holds a NUL byte"),
        (
            {"tokens": torch.tensor(64)},
            "StepMeter\\(tokens=...\\) \\(tokens per step\\) must be an int >= 1, got",
        ),
        (
            {"samples": np.float64(8.0)},
            "StepMeter\\(samples=...\\) \\(samples per step\\) must be an int >= 1",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(autopar.OptionError, match=message):
            StepMeter(dmodel, optimizer, echo=False, **kwargs)
    assert not Path("~").exists()
    meter = StepMeter(dmodel, optimizer, tokens=np.int64(64), timeout_s=np.float32(5.0), echo=False)
    assert (meter.count, meter.timeout_s) == (64, 5.0) and type(meter.count) is int


def test_step_meter_steps_do_not_nest(compiled) -> None:
    dmodel, optimizer = compiled
    meter = StepMeter(dmodel, optimizer, echo=False)
    with pytest.raises(
        autopar.OptionError, match="StepMeter.step\\(\\) was entered inside step 0 of the same"
    ):
        with meter.step():
            with meter.step():
                pass
    assert meter.steps == 0 and meter.records == []
    with contextlib.suppress(ValueError):  # an error inside a step ends it: the next one measures
        with meter.step():
            raise ValueError("the user's")
    with meter.step():
        pass
    assert meter.steps == 1 and len(meter.records) == 1


# --- update modes -------------------------------------------------------------------------------
def test_update_mode_axis_is_a_non_empty_name_and_rejoin_takes_numpy_ranks() -> None:
    for mode in (autopar.Async, autopar.ParameterServer, autopar.Hybrid):
        with pytest.raises(
            autopar.OptionError, match=f"{mode.__name__}\\(axis=...\\) .* a non-empty str, got ''"
        ):
            mode(axis="")
    with pytest.raises(autopar.OptionError, match="rejoin_mesh\\(rank=5\\): the workers are ranks 0 to 1"):
        autopar.rejoin_mesh(autopar.Async(), {"dp": 2}, rank=np.int64(5))
    with pytest.raises(
        autopar.OptionError, match="rejoin_mesh\\(rank=...\\) .* must be an int >= 0, got 1.0"
    ):
        autopar.rejoin_mesh(autopar.Async(), {"dp": 2}, rank=np.float64(1.0))


def test_a_server_save_that_fails_is_reported_and_leaves_the_previous_file(tmp_path: Path) -> None:
    core = param_server.ServerCore(0)
    key = ("w", ())
    meta = {
        "unit": 0,
        "unit_rank": 0,
        "units": 1,
        "bound": 0,
        "optimizer": (torch.optim.SGD, {"lr": 0.1}),
        "keys": [(key, (2,), torch.float32, True)],
    }
    core.join(meta, {key: torch.ones(2)})
    assert core.save(tmp_path / "ck") is None
    (tmp_path / "file").write_text("x")
    problem = core.save(tmp_path / "file" / "ck")
    assert problem.startswith(f"server 0 cannot write {tmp_path / 'file' / 'ck' / 'server-0.pt'}: ")
    with pytest.MonkeyPatch.context() as patch:  # a full disk while writing: the previous file stays
        patch.setattr(torch, "save", lambda *_: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        assert "No space left on device" in core.save(tmp_path / "ck")
    saved = torch.load(tmp_path / "ck" / "server-0.pt", weights_only=True)
    assert torch.equal(saved["pieces"]["w@"], torch.ones(2)) and sorted(
        p.name for p in (tmp_path / "ck").iterdir()
    ) == ["server-0.pt"]


def test_a_worker_save_checks_its_folder_and_that_it_joined() -> None:
    first = types.SimpleNamespace(unit=0, unit_rank=0, _pairs=[])
    for bad, message in ((3, "got int 3"), ("", "got str ''"), ("~/ck", "begins with '~'")):
        with pytest.raises(
            autopar.CheckpointError, match=f"UpdatedModule.save_checkpoint's path .*{message}"
        ):
            UpdatedModule.save_checkpoint(first, bad)
    with pytest.raises(
        autopar.CheckpointError, match="this rank has not joined the servers: call dmodel.optimizer"
    ):
        UpdatedModule.save_checkpoint(first, "ck")
    other = types.SimpleNamespace(unit=1, unit_rank=0, _pairs=[])
    with pytest.raises(autopar.CheckpointError, match="got NoneType None"):
        UpdatedModule.save_checkpoint(other, None)  # every rank checks the folder
    UpdatedModule.save_checkpoint(other, "ck")  # only unit 0's first rank asks the servers
