"""Out-of-range ids under vocab-parallel layouts raise as one device does.

A lookup into a dim split across ranks (a vocab-parallel embedding, the target logit of a
vocab-parallel cross entropy) looks up each rank's block of rows only: an id outside every
block would read zeros where one device raises ``IndexError``. ``autopar.check_ids`` checks the
ids first and raises ``IndexRangeError`` (an ``IndexError``) on every rank together;
``compile(..., check_ids=False)`` leaves it out. In-process: the op alone, the option, the
programs on a fake process group (recompute, a pipeline's stages). One world of 2 gloo ranks:
every case on real values, against one device.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import IndexRangeError, OptionError
from autopar.ir.fake import fake_mode
from autopar.tools.fake_ranks import fake_world
from autopar.tools.launch import spawn

VOCAB = 128
check_ids = torch.ops.autopar.check_ids.default


class _Tiny(nn.Module):
    """A token embedding and an output projection, both split by vocabulary over ``tp``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(ids))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _model(annotated: bool = True) -> _Tiny:
    torch.manual_seed(0)
    model = _Tiny()
    if annotated:
        autopar.shard(model.wte, parameter_plan={"weight": ("tp", None)})
        autopar.shard(model.head, parameter_plan={"weight": ("tp", None)})
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets, each running from 0 to 127."""
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, VOCAB, (2, 4, 8), generator=g)
    ids[0, :2] = target[0, :2] = torch.tensor([0, VOCAB - 1])
    return ids, target


def _with(t: torch.Tensor, value: int) -> torch.Tensor:
    t = t.clone()
    t[1, 2] = value
    return t


# ----------------------------------------------------------------------------- in-process


def test_the_check_passes_ids_in_range_as_a_copy():
    ids = torch.tensor([[3, 127], [0, 5]])
    out = check_ids(ids, VOCAB, "", "lookup 'x'")
    assert torch.equal(out, ids) and out.data_ptr() != ids.data_ptr()
    assert torch.equal(check_ids(ids.int(), VOCAB, "", "lookup 'x'"), ids.int())
    assert check_ids(torch.empty(0, dtype=torch.long), VOCAB, "", "lookup 'x'").shape == (0,)
    with fake_mode():  # what check_local_program runs the program on
        fake = check_ids(torch.empty(4, 8, dtype=torch.long), VOCAB, "", "lookup 'x'")
    assert fake.shape == (4, 8) and fake.dtype == torch.long


@pytest.mark.parametrize(
    "ids, words",
    [
        ([3, 128], "its ids range from 3 to 128"),
        ([-1, 5], "its ids range from -1 to 5"),  # one device takes no negative id in a lookup
        ([-100, 5], "its ids range from -100 to 5"),  # an ignore_index is dropped before the lookup
        ([-(2**63), 2**63 - 1], f"its ids range from {-(2**63)} to {2**63 - 1}"),
    ],
)
def test_the_check_refuses_ids_outside_the_whole_dim(ids, words):
    with pytest.raises(IndexRangeError, match=rf"index out of range in lookup 'x': {words}") as caught:
        check_ids(torch.tensor(ids), VOCAB, "", "lookup 'x'")
    assert isinstance(caught.value, IndexError)  # what one device's users catch
    assert "the dim has 128 rows (ids 0 to 127); one device raises IndexError here" in str(caught.value)


@pytest.mark.parametrize("value", ["no", "false", 1, 0, None, 1.0])
def test_check_ids_is_true_or_false(value):
    ids, _ = _batch()
    with pytest.raises(
        OptionError, match=rf"compile\(check_ids=\.\.\.\) must be True or False, got {value!r}"
    ):
        autopar.compile(_model(), None, (ids,), check_ids=value)


def _compiled(**options):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids, _ = _batch()
    return autopar.compile(_model(), mesh, (ids,), cluster="fast-links", **options)


EMBEDDING_WORDS = (
    "index out of range in embedding 'embedding' of module 'wte' (dim 0 of parameter 'wte.weight', "
    "split over mesh axis 'tp'): its ids range from"
)
GATHER_WORDS = "index out of range in gather 'gather' of module '<root>' (dim 1, split over mesh axis 'tp')"


def test_split_lookups_check_their_ids_in_the_program_and_the_loss_unless_switched_off():
    """On a fake process group (rank 0 of tp=2): the checks are in the model's program and in the
    loss train_step compiles, raise before any value is looked up, and check_ids=False drops both."""
    ids, target = _batch()
    with fake_world(2):
        dmodel = _compiled()
        assert "autopar.check_ids(ids, 128, '', \"embedding 'embedding' of module 'wte'" in dmodel.code
        assert "autopar.block_index(check_ids_default, 'tp', [0, 64, 128])" in dmodel.code
        with pytest.raises(IndexRangeError, match=re.escape(f"{EMBEDDING_WORDS} 0 to 200")) as caught:
            dmodel(_with(ids, 200))
        assert "raised by check_ids_default = autopar.check_ids.default" in caught.value.__notes__[0]
        dmodel.train_step(ids, target, _loss)
        assert "autopar.check_ids(" in dmodel.compiled_loss(_loss).code
        with pytest.raises(
            IndexRangeError, match=re.escape(f"{GATHER_WORDS}: its ids range from 0 to 200")
        ) as caught:
            dmodel.train_step(ids, _with(target, 200), _loss)
        assert "raised by check_ids_default = autopar.check_ids.default" in caught.value.__notes__[0]

        unchecked = _compiled(check_ids=False)
        unchecked.train_step(_with(ids, 200), _with(target, 200), _loss)  # runs: documented, not raised
        assert "check_ids" not in unchecked.code
        assert "check_ids" not in unchecked.compiled_loss(_loss).code
        on_first_call = autopar.compile(_model(), dmodel.device_mesh, check_ids=False, cluster="fast-links")
        on_first_call(ids)
        assert "check_ids" not in on_first_call.code


def test_ids_split_over_an_axis_are_checked_together_over_it():
    """Batch split over dp, vocabulary over tp: the ranks of dp hold other ids, those of tp the same."""
    from torch.distributed.device_mesh import init_device_mesh

    ids, _ = _batch()
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dmodel = autopar.compile(_model(), mesh, (ids,), cluster="fast-links")
    assert "autopar.check_ids(ids, 128, 'dp', \"embedding 'embedding' of module 'wte'" in dmodel.code


def test_the_check_sits_in_a_recompute_region_and_in_the_stage_that_looks_up():
    from torch.distributed.device_mesh import init_device_mesh

    ids, _ = _batch()
    with fake_world(2):
        model = _model()
        autopar.recompute(model.wte)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        dmodel = autopar.compile(model, mesh, (ids,), cluster="fast-links")
        assert "autopar.check_ids(" in dmodel.code and "recompute_0" in dmodel.code
        dmodel(ids).sum().backward()  # the region's check output is kept: nothing runs it twice
        with pytest.raises(IndexRangeError, match=re.escape(f"{EMBEDDING_WORDS} -1 to 127")):
            dmodel(_with(ids, -1))
    from examples import gpt

    model, batch = gpt.build(batch_size=4)
    autopar.shard(model.wte, parameter_plan={"weight": ("tp", None)})
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        dmodel = autopar.compile(model, mesh, batch, cluster="fast-links", pipeline=autopar.Pipeline(2))
        first, last = (stage.code for stage in dmodel._lowered.stages)
    # the token and position lookups (wpe splits too: its ids are the positions) in stage 0 only
    assert first.count("autopar.check_ids(") == 2 and "check_ids" not in last


# ----------------------------------------------------------------------------- 2 gloo ranks


def _attempt(step) -> dict:
    try:
        return {"loss": step().item()}
    except Exception as error:  # noqa: BLE001 - the class and the words go back to the test
        return {
            "error": type(error).__name__,
            "index_error": isinstance(error, IndexError),
            "message": str(error),
        }


def _one_device(ids: torch.Tensor, target: torch.Tensor, zero_at: tuple[int, int] | None = None) -> float:
    """One device's loss; with ``zero_at`` the embedding there is zero and a target out of range
    contributes the log-sum-exp of its logits alone (what check_ids=False computes)."""
    model = _model(annotated=False)
    h = model.wte(ids.clamp(0, VOCAB - 1))
    if zero_at is not None:
        h = h.clone()
        h[zero_at] = 0
    logits = model.head(h).flatten(0, 1)
    target = target.flatten()
    inside = (target >= 0) & (target < VOCAB)
    counted = target != -100
    picked = logits.gather(1, torch.where(inside, target, 0)[:, None])[:, 0] * inside
    items = (logits.logsumexp(1) - picked) * counted
    return (items.sum() / counted.sum()).item()


def _world() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids, target = _batch()
    dmodel = autopar.compile(_model(), mesh, (ids,), cluster="fast-links")
    unchecked = autopar.compile(_model(), mesh, (ids,), cluster="fast-links", check_ids=False)
    ignored = target.clone()
    ignored[0, :3] = -100
    out = {
        "in range": _attempt(lambda: dmodel.train_step(ids, target, _loss)),
        "wte grad": dmodel.wte.weight.grad.full_tensor(),
        "token 200": _attempt(lambda: dmodel.train_step(_with(ids, 200), target, _loss)),
        "token -1": _attempt(lambda: dmodel.train_step(_with(ids, -1), target, _loss)),
        "target 200": _attempt(lambda: dmodel.train_step(ids, _with(target, 200), _loss)),
        "target -1": _attempt(lambda: dmodel.train_step(ids, _with(target, -1), _loss)),
        "ignore_index": _attempt(lambda: dmodel.train_step(ids, ignored, _loss)),
        "in range after": _attempt(lambda: dmodel.train_step(ids, target, _loss)),
        "unchecked target 200": _attempt(lambda: unchecked.train_step(ids, _with(target, 200), _loss)),
        "unchecked token 200": _attempt(lambda: unchecked.train_step(_with(ids, 200), target, _loss)),
    }
    # ids that differ per rank (as when the batch is split) are all-reduced into one verdict
    rank = mesh.get_local_rank("tp")
    theirs = torch.tensor([5, 200]) if rank else torch.tensor([0, 7])
    out["one rank's 200"] = _attempt(lambda: check_ids(theirs, VOCAB, "tp", "lookup 'x'").sum())
    empty = torch.tensor([3, 9]) if rank else torch.empty(0, dtype=torch.long)
    out["one rank empty"] = _attempt(lambda: check_ids(empty, VOCAB, "tp", "lookup 'x'").sum())
    return out


@pytest.mark.distributed
def test_out_of_range_ids_raise_on_every_rank_as_on_one_device():
    ids, target = _batch()
    ignored = target.clone()
    ignored[0, :3] = -100
    reference = _model(annotated=False)
    _loss(reference(ids), target).backward()
    for out in spawn(_world, 2):
        assert out["in range"]["loss"] == pytest.approx(_one_device(ids, target), rel=1e-5)
        assert out["in range after"] == out["in range"]  # nothing left half-done by the errors
        torch.testing.assert_close(out["wte grad"], reference.wte.weight.grad)
        assert out["ignore_index"]["loss"] == pytest.approx(_one_device(ids, ignored), rel=1e-5)
        for case, words, low, high in [
            ("token 200", EMBEDDING_WORDS, 0, 200),
            ("token -1", EMBEDDING_WORDS, -1, 127),
            ("target 200", GATHER_WORDS + ": its ids range from", 0, 200),
            ("target -1", GATHER_WORDS + ": its ids range from", -1, 127),
        ]:
            got = out[case]
            assert got["error"] == "IndexRangeError" and got["index_error"], (case, got)
            assert got["message"].startswith(f"{words} {low} to {high}, but the dim has 128 rows"), got
        # what the unchecked program computes: the target's logit taken as 0, the token's row as zeros
        lse_alone = _one_device(ids, _with(target, 200))
        assert out["unchecked target 200"]["loss"] == pytest.approx(lse_alone, rel=1e-5)
        zero_row = _one_device(_with(ids, 200), target, zero_at=(1, 2))
        assert out["unchecked token 200"]["loss"] == pytest.approx(zero_row, rel=1e-5)
        assert out["one rank's 200"]["message"].startswith(
            "index out of range in lookup 'x': its ids range from 0 to 200"
        )
        assert "error" not in out["one rank empty"]
