"""Checkpoints that cannot lose the last good state, and loads that change nothing until they succeed.

Most cases run in this process on a world of one fake rank (DCP without collectives): a save
killed (a forked child ending itself with ``os._exit``) at 50 random file operations, or
failing on a full disk at random writes, over a previous checkpoint; every way a load can
fail, each leaving the module's parameters and the optimizer's state (a trained Adam, and a
fresh one without state) bit-exact as they were; and the bad arguments. One world of 2 gloo
ranks checks that a failure one rank sees (a damaged file it reads, a full disk where it
writes) is raised on both, and that an overwritten checkpoint round-trips under ZeRO-1.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import autopar
from autopar.runtime.checkpoint_files import is_complete
from autopar.tools.fake_ranks import fake_world
from autopar.tools.launch import spawn


class _Stack(nn.Module):
    """Linear layers of the given widths, each followed by a ReLU; the output summed."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def _build(mesh: Any, widths=(8, 8, 8), seed=0, dtype=torch.float32, **options: Any) -> nn.Module:
    torch.manual_seed(seed)
    model = _Stack(widths).to(dtype)
    return autopar.compile(model, mesh, (torch.randn(4, widths[0], dtype=dtype),), **options)


def _train(dmodel: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(
        4, 8, generator=torch.Generator().manual_seed(seed), dtype=next(dmodel.parameters()).dtype
    )
    dmodel(*dmodel.shard_inputs(x)[0]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(dmodel: nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """Everything a load may change, copied: parameters and buffers, optimizer state, groups, grads."""
    held = [p for g in optimizer.param_groups for p in g["params"]]
    params = {k: v.to_local().clone() for k, v in dmodel.state_dict().items()}
    state = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
        if p in optimizer.state
        else None
        for p in held
    ]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return params, state, groups, [p.grad for p in held]


def _assert_same(a: tuple, b: tuple) -> None:
    assert a[0].keys() == b[0].keys()
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]), "a parameter changed"
    assert [s is None for s in a[1]] == [s is None for s in b[1]], "optimizer state appeared or vanished"
    for x, y in zip(a[1], b[1]):
        if x is not None:
            assert x.keys() == y.keys() and all(
                torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x
            ), "optimizer state changed"
    assert a[2] == b[2] and a[3] == b[3]


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(1):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


@pytest.fixture(scope="module")
def saved(mesh: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints after one Adam step: of the (8, 8, 8) model, and of other models and optimizers."""
    root = tmp_path_factory.mktemp("saved")
    variants: dict[str, tuple[dict, Callable | None]] = {
        "good": ({}, torch.optim.Adam),
        "wider": ({"widths": (8, 16, 8)}, torch.optim.Adam),
        "smaller": ({"widths": (8, 8)}, torch.optim.Adam),
        "bigger": ({"widths": (8, 8, 8, 8)}, torch.optim.Adam),
        "float64": ({"dtype": torch.float64}, torch.optim.Adam),
        "amsgrad": ({}, lambda params, lr: torch.optim.Adam(params, lr=lr, amsgrad=True)),
        "no optimizer": ({}, None),
    }
    paths = {}
    for name, (options, kind) in variants.items():
        dmodel = _build(mesh, **options)
        optimizer = dmodel.optimizer(kind or torch.optim.SGD, lr=0.01)
        _train(dmodel, optimizer, 0)
        paths[name] = root / name
        autopar.save_checkpoint(paths[name], dmodel, optimizer if kind else None, step=1)
    return paths


@pytest.fixture(scope="module")
def targets(mesh: Any) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """What failed loads must leave as it was: a trained module with Adam's state, a fresh one without."""
    trained = _build(mesh, seed=1)
    optimizer = trained.optimizer(torch.optim.Adam, lr=0.01)
    _train(trained, optimizer, 1)
    fresh = _build(mesh, seed=2)
    return [(trained, optimizer), (fresh, fresh.optimizer(torch.optim.Adam, lr=0.01))]


# --- a save cut short by a kill or a full disk --------------------------------------------------
class _FileOps:
    """Counts the file operations of a save (opens, writes, flushes, closes, fsyncs, renames,
    folder creation and removal) and calls ``action`` at the ``at``-th one of ``kinds``."""

    def __init__(self, at: int = 0, action: Callable[[], None] | None = None, kinds=None) -> None:
        self.count, self.at, self.action, self.kinds = 0, at, action, kinds

    def tick(self, kind: str) -> None:
        if self.kinds is None or kind in self.kinds:
            self.count += 1
            if self.count == self.at and self.action is not None:
                self.action()

    def wrap(self, kind: str, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.tick(kind)
            return fn(*args, **kwargs)

        return wrapped

    @contextlib.contextmanager
    def hooked(self) -> Iterator[_FileOps]:
        ops, opener = self, io.open

        class Stream:
            def __init__(self, raw: Any) -> None:
                self._raw = raw

            def write(self, data: Any) -> int:
                ops.tick("write")
                return self._raw.write(data)

            def flush(self) -> None:
                ops.tick("flush")
                self._raw.flush()

            def close(self) -> None:
                ops.tick("close")
                self._raw.close()

            def __enter__(self) -> Stream:
                return self

            def __exit__(self, *_: Any) -> None:
                self.close()

            def __getattr__(self, name: str) -> Any:
                return getattr(self._raw, name)

        def open_(*args: Any, **kwargs: Any) -> Any:
            ops.tick("open")
            return Stream(opener(*args, **kwargs))

        names = ["fsync", "rename", "replace", "mkdir", "unlink", "rmdir"]
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch("io.open", open_))
            stack.enter_context(mock.patch("builtins.open", open_))
            for name in names:
                stack.enter_context(mock.patch.object(os, name, self.wrap(name, getattr(os, name))))
            yield self


def _state_is(dmodel, optimizer, snapshots: dict[int, tuple]) -> int:
    """The step whose snapshot the module and optimizer equal, bit-exact."""
    now = _snapshot(dmodel, optimizer)
    for step, snap in snapshots.items():
        with contextlib.suppress(AssertionError):
            _assert_same(now, snap)
            return step
    raise AssertionError("the loaded state is neither checkpoint's")


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_a_save_killed_or_out_of_disk_at_any_point_leaves_the_last_complete_checkpoint(mesh, tmp_path):
    dmodel = _build(mesh)
    optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
    reader = _build(mesh, seed=3)
    into = reader.optimizer(torch.optim.Adam, lr=0.01)
    _train(dmodel, optimizer, 0)
    root, target, first = tmp_path / "ck", tmp_path / "ck" / "latest", tmp_path / "first"
    autopar.save_checkpoint(first, dmodel, optimizer, step=1)
    snapshots = {1: _snapshot(dmodel, optimizer)}
    _train(dmodel, optimizer, 1)
    snapshots[2] = _snapshot(dmodel, optimizer)
    root.mkdir()
    shutil.copytree(first, target)
    # a kill between two writes into one file leaves what a kill before its close does: the kill
    # points are drawn over the other operations, the full disk's over the writes
    kinds = {"open", "flush", "close", "fsync", "rename", "replace", "mkdir", "unlink", "rmdir"}
    with _FileOps(kinds=kinds).hooked() as counted:  # a whole save over a previous checkpoint
        autopar.save_checkpoint(target, dmodel, optimizer, step=2)
    assert counted.count > 20 and _leftovers(root) == []
    draw = random.Random(0)
    finished, outcomes, seen = 0, set(), set()
    for at in sorted(draw.randint(1, counted.count) for _ in range(50)):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(first, target)
        pid = os.fork()
        if pid == 0:  # the child saves step 2 and dies at its at-th file operation
            code = 0
            try:
                with _FileOps(at, lambda: os._exit(9), kinds).hooked():
                    autopar.save_checkpoint(target, dmodel, optimizer, step=2)
            except BaseException:  # noqa: BLE001 - the parent sees the exit code
                code = 1
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert code in (0, 9), f"the save killed at operation {at} failed otherwise"
        finished += code == 0
        switched = target.exists()
        assert autopar.latest_checkpoint(root) == target and is_complete(target)
        step = autopar.load_checkpoint(target, reader, into)
        assert _state_is(reader, into, snapshots) == step, at
        assert code == 9 or step == 2, f"a finished save (operation {at}) did not switch in"
        outcomes.add((step, switched))
        for name in set(_leftovers(root)) - seen:  # what this kill left beside the path
            seen.add(name)
            if is_complete(root / name):  # complete: it loads, as one of the two checkpoints
                assert autopar.load_checkpoint(root / name, reader, into) == _state_is(
                    reader, into, snapshots
                )
            else:  # unfinished: never taken for a checkpoint
                assert autopar.latest_checkpoint(root) == target
                with pytest.raises(autopar.CheckpointError, match="is not a complete checkpoint"):
                    autopar.load_checkpoint(root / name, reader, into)
    # killed before the manifest (the previous checkpoint), between the renames (the new one, found
    # beside the missing path) and after them (the new one)
    assert outcomes == {(1, True), (2, False), (2, True)} and finished < 50
    # a full disk (or a file too large) at a random write: an error, and nothing changed
    writes = _FileOps(kinds={"write"})
    with writes.hooked():
        autopar.save_checkpoint(tmp_path / "counted", dmodel, optimizer, step=2)
    for i, at in enumerate(sorted(draw.randint(1, writes.count) for _ in range(20))):
        shutil.rmtree(root)
        root.mkdir()
        shutil.copytree(first, target)
        code = errno.EFBIG if i % 4 == 0 else errno.ENOSPC

        def full(code: int = code) -> None:
            raise OSError(code, os.strerror(code))

        with pytest.raises(autopar.CheckpointError, match=f"cannot save a checkpoint at {target}") as error:
            with _FileOps(at, full, {"write"}).hooked():
                autopar.save_checkpoint(target, dmodel, optimizer, step=2)
        assert os.strerror(code) in str(error.value) and isinstance(error.value.__cause__, OSError)
        assert _leftovers(root) == [], "the failed save's folder was left behind"
        assert autopar.load_checkpoint(target, reader, into) == 1
        _assert_same(_snapshot(reader, into), snapshots[1])


def test_a_switch_cut_between_its_renames_loads_the_new_checkpoint_and_the_next_save_cleans_up(
    mesh, tmp_path
):
    dmodel = _build(mesh)
    optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
    target = tmp_path / "latest"
    autopar.save_checkpoint(target, dmodel, optimizer, step=1)
    _train(dmodel, optimizer, 0)
    rename = os.rename

    def cut(src: Any, dst: Any) -> None:
        if Path(dst) == target:  # the old checkpoint is aside, the new one not yet in place
            raise OSError(errno.EIO, "Input/output error")
        rename(src, dst)

    with mock.patch.object(os, "rename", cut):
        with pytest.raises(autopar.CheckpointError, match="cannot switch the new checkpoint in at .*latest"):
            autopar.save_checkpoint(target, dmodel, optimizer, step=2)
    assert not target.exists() and len(_leftovers(tmp_path)) == 2
    assert is_complete(target) and autopar.latest_checkpoint(tmp_path) == target
    reader = _build(mesh, seed=3)
    assert autopar.load_checkpoint(target, reader) == 2
    assert all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(reader.parameters(), dmodel.parameters())
    )
    autopar.save_checkpoint(target, dmodel, optimizer, step=3)
    assert _leftovers(tmp_path) == [] and autopar.latest_checkpoint(tmp_path) == target


# --- loads that fail change nothing -------------------------------------------------------------
def _damage(folder: Path, how: str) -> None:
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if how == "truncated":
        data.write_bytes(raw[: len(raw) // 2])
    elif how == "zeroed":
        data.write_bytes(bytes(len(raw)))
    elif how == "bit rot":
        middle = len(raw) // 2
        raw[middle : middle + 64] = bytes(b ^ 0x5A for b in raw[middle : middle + 64])
        data.write_bytes(raw)
    elif how == "no .metadata":
        (folder / ".metadata").unlink()
    elif how == "no manifest":
        (folder / "manifest.json").unlink()
    elif how == "empty folder":
        shutil.rmtree(folder)
        folder.mkdir()
    elif how == "killed first save":  # only the unfinished hidden folder is there
        folder.rename(folder.with_name(f".{folder.name}.autopar-new-0123456789ab"))
        (folder.with_name(f".{folder.name}.autopar-new-0123456789ab") / "manifest.json").unlink()
    elif how == "a file":
        shutil.rmtree(folder)
        folder.write_text("not a folder")
    elif how.startswith("manifest"):
        manifest = json.loads((folder / "manifest.json").read_text())
        text = {
            "manifest format 2": json.dumps({**manifest, "format": 2}),
            "manifest unknown key": json.dumps({**manifest, "extra": 1}),
            "manifest step 2.5": json.dumps({**manifest, "step": 2.5}),
            "manifest not json": "{not json",
        }[how]
        (folder / "manifest.json").write_text(text)


LOAD_FAILURES = [
    ("good", "truncated", r"__0_0\.distcp is \d+ bytes, manifest\.json records \d+ \(truncated"),
    ("good", "zeroed", r"__0_0\.distcp does not match its sha256 in manifest\.json \(its bytes changed"),
    ("good", "bit rot", r"__0_0\.distcp does not match its sha256 in manifest\.json"),
    ("good", "no .metadata", r"\.metadata, listed in manifest\.json, is missing"),
    ("good", "no manifest", r"is not a complete checkpoint: it has no manifest\.json"),
    ("good", "empty folder", r"is not a complete checkpoint: it has no manifest\.json"),
    ("good", "killed first save", r"no checkpoint at .*/good: save_checkpoint writes a folder there"),
    ("good", "a file", r"good is a file, not a checkpoint's folder"),
    ("good", "manifest format 2", r"has format 2, this autopar reads format 1"),
    (
        "good",
        "manifest unknown key",
        r"manifest\.json is not a manifest save_checkpoint wrote: expected the keys",
    ),
    ("good", "manifest step 2.5", r"format 1 and step 2\.5 must be ints >= 0"),
    ("good", "manifest not json", r"cannot read .*manifest\.json"),
    (
        "wider",
        "",
        r"'layers\.0\.weight' is \(16, 8\) torch\.float32 in checkpoint .*, but \(8, 8\) torch\.float32",
    ),
    (
        "float64",
        "",
        r"'layers\.0\.weight' is \(8, 8\) torch\.float64 in checkpoint .*, but \(8, 8\) torch\.float32",
    ),
    (
        "smaller",
        "",
        r"has no 'layers\.1\.bias' \(and 1 more\) of this module: it was saved from another model",
    ),
    ("bigger", "", r"holds 'layers\.2\.bias' \(and 1 more\), which this module does not have"),
    (
        "amsgrad",
        "",
        r"holds 'layers\.0\.bias\.max_exp_avg_sq' \(and 3 more\), which the optimizer \(torch\.optim",
    ),
    (
        "no optimizer",
        "",
        r"was saved without an optimizer, but load_checkpoint was given torch\.optim\.adam\.Adam",
    ),
]


@pytest.mark.parametrize(
    ("source", "damage", "message"), LOAD_FAILURES, ids=[d or s for s, d, _ in LOAD_FAILURES]
)
def test_a_failed_load_raises_and_leaves_module_and_optimizer_bit_exact(
    saved, targets, tmp_path, source, damage, message
):
    folder = tmp_path / source
    shutil.copytree(saved[source], folder)
    _damage(folder, damage)
    for dmodel, optimizer in targets:
        before, rng = _snapshot(dmodel, optimizer), torch.get_rng_state()
        with pytest.raises(autopar.CheckpointError, match=message) as error:
            autopar.load_checkpoint(folder, dmodel, optimizer)
        assert isinstance(error.value, autopar.AutoparError) and isinstance(error.value, RuntimeError)
        _assert_same(_snapshot(dmodel, optimizer), before)
        assert torch.equal(torch.get_rng_state(), rng)


def test_a_load_failing_while_it_reads_changes_nothing(saved, targets):
    """An I/O error after DCP has read every value: the values went into fresh tensors, not the module's."""
    read = torch.distributed.checkpoint.FileSystemReader.read_data

    def read_then_fail(self: Any, *args: Any) -> Any:
        read(self, *args)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    for dmodel, optimizer in targets:
        before = _snapshot(dmodel, optimizer)
        with mock.patch.object(torch.distributed.checkpoint.FileSystemReader, "read_data", read_then_fail):
            with pytest.raises(
                autopar.CheckpointError, match="nothing was changed: OSError: .*Input/output error"
            ):
                autopar.load_checkpoint(saved["good"], dmodel, optimizer)
        _assert_same(_snapshot(dmodel, optimizer), before)


def test_another_optimizer_class_or_other_groups_are_refused_and_change_nothing(mesh, saved):
    dmodel = _build(mesh, seed=4)
    sgd = dmodel.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    _train(dmodel, sgd, 4)
    params = list(dmodel.parameters())
    groups = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}], lr=0.01)
    cases = [
        (
            sgd,
            "was saved with the optimizer torch.optim.adam.Adam, "
            "but load_checkpoint was given torch.optim.sgd.SGD",
        ),
        (groups, "holds 1 optimizer parameter groups, the optimizer given has 2"),
    ]
    for optimizer, message in cases:
        before = _snapshot(dmodel, optimizer)
        with pytest.raises(autopar.CheckpointError, match=message):
            autopar.load_checkpoint(saved["good"], dmodel, optimizer)
        _assert_same(_snapshot(dmodel, optimizer), before)


def test_a_load_round_trips_bit_exact_and_optimizer_state_follows_the_checkpoint(mesh, saved, tmp_path):
    dmodel = _build(mesh)
    optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
    autopar.save_checkpoint(tmp_path / "before-step", dmodel, optimizer, step=0)  # Adam without state
    _train(dmodel, optimizer, 0)
    rng = torch.get_rng_state()
    autopar.save_checkpoint(tmp_path / "step-7", dmodel, optimizer, step=7)
    want = _snapshot(dmodel, optimizer)
    reader = _build(mesh, seed=5)
    into = reader.optimizer(torch.optim.Adam, lr=0.5)
    torch.manual_seed(99)
    assert autopar.load_checkpoint(tmp_path / "step-7", reader, into) == 7
    _assert_same(_snapshot(reader, into), want)
    assert torch.equal(torch.get_rng_state(), rng)
    assert autopar.load_checkpoint(tmp_path / "before-step", reader, into) == 0
    assert len(into.state) == 0  # as the checkpoint holds it: no state yet
    alone = _build(mesh, seed=6)
    assert autopar.load_checkpoint(tmp_path / "step-7", alone) == 7  # the module alone
    assert all(torch.equal(alone.state_dict()[k].to_local(), want[0][k]) for k in want[0])
    assert autopar.latest_checkpoint(tmp_path) == tmp_path / "step-7"
    assert autopar.latest_checkpoint(tmp_path / "step-7") is None


# --- bad arguments ------------------------------------------------------------------------------
def test_bad_arguments_are_checkpoint_errors_naming_what_was_given(mesh, tmp_path):
    dmodel = _build(mesh)
    optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
    other = _build(mesh, seed=1).optimizer(torch.optim.Adam, lr=0.01)
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    ok = tmp_path / "ok"
    save_cases = [
        (
            (ok, nn.Linear(2, 2), None),
            {},
            "save_checkpoint's module must be a module autopar.compile returned, "
            "got Linear: compile it first",
        ),
        ((ok, optimizer, dmodel), {}, "got Adam: the module goes before the optimizer"),
        (
            (ok, dmodel, dmodel),
            {},
            "save_checkpoint's optimizer must be a torch.optim.Optimizer or None, got DistributedModule",
        ),
        (
            (ok, dmodel, other),
            {},
            r"the optimizer steps a tensor of shape \(8, 8\) that is no parameter of this module",
        ),
        (("", dmodel), {}, "save_checkpoint's path must be a non-empty str or os.PathLike .*, got str ''"),
        ((None, dmodel), {}, "path must be a non-empty str or os.PathLike .*, got NoneType None"),
        ((b"ck", dmodel), {}, "path must be .*, got bytes b'ck'"),
        (("/", dmodel), {}, "path '/' names no folder"),
        ((ok, dmodel), {"step": 2.7}, "save_checkpoint's step must be an int >= 0, got float 2.7"),
        ((ok, dmodel), {"step": True}, "step must be an int >= 0, got bool True"),
        ((ok, dmodel), {"step": -1}, "step must be an int >= 0, got int -1"),
        ((ok, dmodel), {"step": "3"}, "step must be an int >= 0, got str '3'"),
        ((ok, dmodel), {"step": float("nan")}, "step must be an int >= 0, got float nan"),
        ((tmp_path / "file" / "ck", dmodel), {}, "cannot create the folder .*File exists"),
        ((tmp_path / "file", dmodel), {}, "it is a file, not a checkpoint's folder"),
        ((tmp_path / "notes", dmodel), {}, "the folder holds files save_checkpoint did not write"),
        (
            ("/proc/autopar/ck", dmodel),
            {},
            "cannot save a checkpoint at /proc/autopar/ck: cannot create the folder",
        ),
    ]
    for args, kwargs, message in save_cases:
        with pytest.raises(autopar.CheckpointError, match=message):
            autopar.save_checkpoint(*args, **kwargs)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me" and not ok.exists()
    with mock.patch.object(Path, "mkdir", side_effect=PermissionError(errno.EACCES, "Permission denied")):
        with pytest.raises(
            autopar.CheckpointError, match="cannot create the folder .*Permission denied"
        ) as error:
            autopar.save_checkpoint(ok, dmodel)
    assert isinstance(error.value.__cause__, PermissionError)
    autopar.save_checkpoint(ok, dmodel, optimizer, step=1)
    load_cases = [
        (
            (ok, optimizer, dmodel),
            "load_checkpoint's module must be .*, got Adam: the module goes before the optimizer",
        ),
        (
            (ok, nn.Linear(2, 2)),
            "load_checkpoint's module must be a module autopar.compile returned, got Linear",
        ),
        (
            (ok, dmodel, "adam"),
            "load_checkpoint's optimizer must be a torch.optim.Optimizer or None, got str",
        ),
        ((ok, dmodel, other), "the optimizer steps a tensor of shape .* that is no parameter of this module"),
        (("", dmodel), "load_checkpoint's path must be a non-empty str or os.PathLike"),
        ((tmp_path / "nowhere", dmodel), "no checkpoint at .*nowhere: save_checkpoint writes a folder there"),
    ]
    for args, message in load_cases:
        with pytest.raises(autopar.CheckpointError, match=message):
            autopar.load_checkpoint(*args)
    assert autopar.latest_checkpoint(tmp_path / "nowhere") is None
    with pytest.raises(autopar.CheckpointError, match="latest_checkpoint: .*file is a file, not a folder"):
        autopar.latest_checkpoint(tmp_path / "file")
    with pytest.raises(autopar.CheckpointError, match="latest_checkpoint's path must be a non-empty str"):
        autopar.latest_checkpoint(3)
    with pytest.raises(
        autopar.CheckpointError, match="is_complete's path must be a non-empty str .*got bool"
    ):
        is_complete(True)
    assert not is_complete(tmp_path / "notes") and is_complete(ok)


# --- two ranks ----------------------------------------------------------------------------------
def _two_ranks(folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    options = {"memory": autopar.Memory(zero=1), "cluster": "fast-links"}
    dmodel = _build(mesh, **options)
    optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
    target = Path(folder) / "latest"
    _train(dmodel, optimizer, 0)
    autopar.save_checkpoint(target, dmodel, optimizer, step=1)
    _train(dmodel, optimizer, 1)
    autopar.save_checkpoint(target, dmodel, optimizer, step=2)  # over the first
    out: dict[str, Any] = {"leftovers": _leftovers(Path(folder)), "files": sorted(os.listdir(target))}
    reader = _build(mesh, seed=7, **options)
    into = reader.optimizer(torch.optim.Adam, lr=0.01)
    out["step"] = autopar.load_checkpoint(target, reader, into)
    out["same"] = _equal(reader, into, dmodel, optimizer)

    # a full disk on rank 1 only: both ranks raise, the checkpoint stays step 2
    def full() -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with _FileOps(1, full if rank == 1 else None, {"write"}).hooked():
        try:
            autopar.save_checkpoint(target, dmodel, optimizer, step=3)
        except autopar.CheckpointError as exc:
            out["full disk"] = str(exc)
    out["after full disk"] = autopar.load_checkpoint(target, _build(mesh, seed=8, **options))
    torch.distributed.barrier()
    if rank == 0:  # bit rot in the file rank 1 wrote, which rank 0 checks
        data = target / "__1_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[100:164] = bytes(64)
        data.write_bytes(raw)
    torch.distributed.barrier()
    fresh = _build(mesh, seed=9, **options)
    adam = fresh.optimizer(torch.optim.Adam, lr=0.01)
    before = _snapshot(fresh, adam)
    try:
        autopar.load_checkpoint(target, fresh, adam)
    except autopar.CheckpointError as exc:
        out["bit rot"] = str(exc)
    _assert_same(_snapshot(fresh, adam), before)
    return out


def _equal(a: nn.Module, a_opt: torch.optim.Optimizer, b: nn.Module, b_opt: torch.optim.Optimizer) -> bool:
    """Parameters and optimizer state of ``a`` equal ``b``'s, bit-exact."""
    try:
        _assert_same(_snapshot(a, a_opt), _snapshot(b, b_opt))
    except AssertionError:
        return False
    return True


@pytest.mark.distributed
def test_on_two_ranks_a_failure_one_rank_sees_is_raised_on_both(tmp_path):
    results = spawn(_two_ranks, 2, str(tmp_path))
    for out in results:
        assert out["leftovers"] == [] and out["step"] == 2 and out["same"]
        assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
        assert "No space left on device" in out["full disk"] and out["after full disk"] == 2
        assert "__1_0.distcp does not match its sha256" in out["bit rot"]
    assert results[0]["bit rot"] == results[1]["bit rot"]


def test_paths_surely_mistaken_numpy_steps_and_files_a_save_would_remove(mesh, tmp_path):
    dmodel = _build(mesh)
    optimizer = dmodel.optimizer(torch.optim.Adam, lr=0.01)
    _train(dmodel, optimizer, 0)
    path_cases = [
        ("~/ck", "save_checkpoint's path '~/ck' begins with '~', which Python does not expand"),
        ("ab\0c", "save_checkpoint's path 'ab\\\\x00c' holds a NUL byte"),
        ("   ", "save_checkpoint's path '   ' names '   ', blank or with spaces around it"),
        (str(tmp_path / "ck "), "names 'ck ', blank or with spaces around it"),
    ]
    for path, message in path_cases:
        with pytest.raises(autopar.CheckpointError, match=message):
            autopar.save_checkpoint(path, dmodel, optimizer)
    with pytest.raises(autopar.CheckpointError, match=r"latest_checkpoint's path '~/ckpt' begins with '~'"):
        autopar.latest_checkpoint("~/ckpt")
    assert not Path("~").exists() and not Path("   ").exists()
    # a numpy integer is the int it equals; a tensor or a float is not a step
    autopar.save_checkpoint(tmp_path / "np", dmodel, optimizer, step=np.int64(5))
    assert json.loads((tmp_path / "np" / "manifest.json").read_text())["step"] == 5
    assert autopar.load_checkpoint(tmp_path / "np", dmodel, optimizer) == 5
    with pytest.raises(
        autopar.CheckpointError, match=r"step must be an int >= 0, got Tensor tensor\(5\): pass"
    ):
        autopar.save_checkpoint(tmp_path / "t", dmodel, step=torch.tensor(5))
    with pytest.raises(autopar.CheckpointError, match="step must be an int >= 0, got float64 np.float64"):
        autopar.save_checkpoint(tmp_path / "t", dmodel, step=np.float64(5.0))
    # inside a checkpoint, a save would be removed by the next save of that checkpoint
    with pytest.raises(autopar.CheckpointError, match=r"it lies inside the checkpoint .*np, whose next save"):
        autopar.save_checkpoint(tmp_path / "np" / "inner", dmodel)
    # a checkpoint holding a file of the user's is not replaced (the switch would remove the file)
    (tmp_path / "np" / "notes.txt").write_text("keep me")
    with pytest.raises(autopar.CheckpointError, match="the checkpoint there also holds 'notes.txt'"):
        autopar.save_checkpoint(tmp_path / "np", dmodel, optimizer, step=6)
    assert (tmp_path / "np" / "notes.txt").read_text() == "keep me"
    assert autopar.load_checkpoint(tmp_path / "np", dmodel, optimizer) == 5 and _leftovers(tmp_path) == []
