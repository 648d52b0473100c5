"""Per-rank programs of hand-written code: valid on every rank's pieces, and errors that name the user's code.

Runs on torch's fake process group (collectives answer without communicating), so the programs
compute on real local pieces; numerics against one device are the model zoo's (4 gloo ranks,
``tests/test_model_zoo.py``, which trains these hand-written models too).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar import compiler
from autopar.ir.fake import fake_mode
from autopar.passes import localize_views
from autopar.passes.context import PassContext
from examples.handwritten import HANDWRITTEN


def _heads_split_gpt() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model, args, _ = HANDWRITTEN["mini-gpt (heads over tp)"]()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return autopar.compile(model, mesh, args, cluster="fast-links"), args


def test_a_view_of_heads_a_rank_lays_out_otherwise_runs_as_a_reshape(fake_process_group):
    # one device's attention output is token-major, so `.transpose(1, 2).contiguous().view(...)`
    # recorded no copy; a rank's attention over its own heads returns them head-major
    dmodel, args = _heads_split_gpt()
    local_args, _ = dmodel.shard_inputs(*args)
    logits, loss = dmodel(*local_args)
    assert logits.shape[1:] == (8, 128) and loss.shape == ()
    targets = {n.target for n in dmodel._program.graph.nodes}
    assert torch.ops.aten.view.default not in targets and torch.ops.aten.reshape.default in targets


def test_a_view_whose_storage_is_written_in_place_stays_a_view():
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    base = graph.call_function(torch.ops.aten.clone.default, (x,))
    viewed = graph.call_function(torch.ops.aten.view.default, (base, [8]))
    written = graph.call_function(torch.ops.aten.add_.Tensor, (viewed, 1.0))
    other = graph.call_function(torch.ops.aten.view.default, (y, [8]))
    graph.output((base, written, other))
    x.meta["val"], y.meta["val"] = torch.zeros(2, 4), torch.zeros(2, 4)
    base.meta["val"] = torch.zeros(2, 4)
    viewed.meta["val"] = written.meta["val"] = base.meta["val"].view(8)
    other.meta["val"] = y.meta["val"].view(8)
    localize_views.run(torch.fx.GraphModule(torch.nn.Module(), graph), PassContext.__new__(PassContext))
    assert viewed.target is torch.ops.aten.view.default  # a copy would lose the write into base
    assert other.target is torch.ops.aten.reshape.default


def test_an_error_raised_inside_the_program_names_the_users_module_and_forward(fake_process_group):
    dmodel, args = _heads_split_gpt()
    program = dmodel._program
    broken = next(n for n in program.graph.nodes if n.target is torch.ops.aten.reshape.default)
    broken.target, broken.args = torch.ops.aten.view.default, (broken.args[0], [7, 7])
    program.recompile()
    try:
        dmodel(*dmodel.shard_inputs(*args)[0])
    except RuntimeError as e:
        (note,) = e.__notes__
    else:
        raise AssertionError("the broken view ran")
    assert f"raised by {broken.name} = aten.view.default in the per-rank program" in note
    assert "from module 'transformer.h.0.attn' (FusedSelfAttention.forward (" in note
    assert "examples/handwritten.py:" in note
    # compile captures with stack traces: the user's line that recorded the op
    assert note.endswith("in forward: k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)")


def test_a_lowering_that_leaves_an_impossible_op_fails_at_compile_time_naming_it(
    fake_process_group, monkeypatch
):
    # without localize_views, the recorded view of the attention output cannot run on a rank
    without = tuple(p for p in compiler.PASS_ORDER if p is not localize_views)
    monkeypatch.setattr(compiler, "PASS_ORDER", without)
    with pytest.raises(autopar.CompileError) as e:
        _heads_split_gpt()
    message = str(e.value)
    assert "the per-rank program at mesh coordinates (0, 0) fails at view_3 = aten.view.default" in message
    assert "an op recorded from module 'transformer.h.0.attn' at File " in message
    assert "in forward: y = y.transpose(1, 2).contiguous().view(B, T, C): ValueError: Cannot view" in message
    assert "as a tensor with shape (2, 8, 32)" in message  # the rank's strides allow no such view


def test_fake_mode_makes_tensors_that_hold_no_memory():
    # the one adapter onto torch's private fake tensors (autopar.ir.fake)
    with fake_mode():
        huge = torch.empty(2**40, dtype=torch.float32)
        doubled = huge * 2
    assert doubled.shape == (2**40,) and doubled.dtype == torch.float32
    assert type(doubled).__name__ == "FakeTensor"
