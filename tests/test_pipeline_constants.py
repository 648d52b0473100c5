"""Constant buffers under a pipeline: copied into every stage that reads them, never refused.

A rotary table registered as a buffer (``register_buffer(..., persistent=False)``) is read by
every layer. No op writes it and it gets no gradient, so each stage reading it holds a copy
(and counts it in its memory), where a tied weight or a buffer written in place (batch norm's
running statistics) must live in one stage and is refused across two. Planning is checked
without ranks; training runs on 2 gloo ranks (one spawn for the file) against one device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.capture.export import capture
from autopar.ir.mesh import MeshSpec
from autopar.planning.pipeline.stage_nodes import constant_buffers
from autopar.planning.pipeline.stage_split import PipelineFitError, UnitCosts, partition
from autopar.tools.launch import spawn
from examples.handwritten import HANDWRITTEN, LlamaArgs, ReferenceLlama

ATOL, RTOL = 1e-5, 1e-4
# the placeholder of the rotary table: in a _TablePerLayer, and in the reference (under its loss)
TABLE, REFERENCE_TABLE = "b_freqs_cis", "b_model_freqs_cis"


class _TablePerLayer(ReferenceLlama):
    """The reference Llama with its loss, each layer slicing the rotary table itself (as
    torchtitan's ``reshape_for_broadcast`` does): every stage reads the buffer, where the
    reference slices it once and sends the slice along the stages."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis[: tokens.shape[1]])
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def _table_per_layer(n_layers: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = _TablePerLayer(LlamaArgs(n_layers=n_layers))
    ids = torch.randint(0, model.args.vocab_size, (4, 8))
    return model, (ids, ids)


class _Scaled(nn.Linear):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * scale


class _ScaledLayers(nn.Module):
    """Layers that all read one buffer, which the forward then updates in place."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Scaled(8, 8) for _ in range(n_layers))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.scale)
        self.scale.mul_(0.9)
        return x.sum()


class _Buffers(nn.Module):
    """A buffer written through a view in a no-grad region, one only read there, and batch norm's
    running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("written", torch.ones(4))
        self.register_buffer("read", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.written.view(2, 2).add_(1)
            table = torch.cos(self.read)
        return (self.norm(x) * self.written * table).sum()


# --------------------------------------------------------------------------- planning


def test_only_buffers_no_op_writes_are_constants():
    captured = capture(_Buffers(), (torch.randn(8, 4),), {}, MeshSpec.of({"dp": 1}))
    assert constant_buffers(captured) == {"b_read"}  # not the running statistics nor `written`


def test_a_constant_buffer_is_in_every_stage_that_reads_it():
    torch.manual_seed(0)
    model, args = _table_per_layer(n_layers=4)
    plan = autopar.plan(model, args, {"pp": 2, "dp": 1}, pipeline=autopar.Pipeline(4, "interleaved-1f1b", 2))
    stages = plan.pipeline.node_stages
    readers = {stages[n.name] for n in _readers(model, args, TABLE)}
    assert readers == {0, 1, 2, 3}  # every stage slices the table
    table = model.freqs_cis.numel() * model.freqs_cis.element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # on one device per stage: each stage's parameters and a copy of the table
    assert sum(s.param_bytes for s in plan.pipeline.stages) == weights + 4 * table


def _readers(model: nn.Module, args: tuple, placeholder: str) -> list[torch.fx.Node]:
    captured = capture(model, args, {}, MeshSpec.of({"dp": 1}))
    (node,) = (n for n in captured.graph.nodes if n.name == placeholder)
    return list(node.users)


def test_a_tied_weight_or_a_written_buffer_is_refused_across_stages():
    torch.manual_seed(0)
    model, args, _ = HANDWRITTEN["mini-gpt"]()  # the embedding and the head share one weight
    mesh, pipeline = {"pp": 2, "dp": 1}, autopar.Pipeline(2)
    tied = r"parameter 'transformer.wte.weight' = 'lm_head.weight' is used in pipeline stages \[0, 1\]"
    with pytest.raises(autopar.AnnotationError, match=tied):
        autopar.plan(model, args, mesh, pipeline=pipeline)
    written = r"parameter 'scale' is used in pipeline stages \[0, 1\]"  # batch norm's statistics, say
    with pytest.raises(autopar.AnnotationError, match=written):
        autopar.plan(_ScaledLayers(), (torch.randn(4, 8),), mesh, pipeline=pipeline)


def test_a_split_counts_a_copied_constant_once_in_each_stage_reading_it():
    # units 0 and 3 read a constant of 10 bytes: both stages of any split hold a copy
    costs = UnitCosts([3.0, 1.0, 1.0, 1.0], [1.0] * 4, [0.0] * 4, [0.0] * 4, copied_bytes={(0, 3): 10.0})
    pipeline = autopar.Pipeline(2)
    assert partition(costs, pipeline, 2, 13.0) == [0, 1, 1, 1]  # the fastest split: 3 s each
    assert partition(costs, pipeline, 2, 12.0) == [0, 0, 1, 1]  # its second stage holds 13 bytes
    with pytest.raises(PipelineFitError, match="the smallest stage needs"):
        partition(costs, pipeline, 2, 11.9)


# --------------------------------------------------------------------------- training


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _train(
    model: nn.Module, reference: nn.Module, args: tuple, pipeline: autopar.Pipeline
) -> list[list[str]]:
    """Two SGD steps of ``model`` pipelined over this world's ranks against ``reference`` on one
    device: the loss and every gradient this rank holds; the state names of this rank's stages."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    reference.load_state_dict(model.state_dict())
    dmodel = autopar.compile(model, mesh, args, pipeline=pipeline)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (dmodel, reference)]
    for step in range(2):
        torch.manual_seed(step)
        ids, labels = (torch.randint(0, 128, args[0].shape) for _ in range(2))
        loss = dmodel.train_step((ids, labels))
        ref_loss = reference(ids, labels)
        ref_loss.backward()
        where = f"{type(model).__name__}, step {step}"
        _close(loss, ref_loss.detach(), where)
        for name, p in dmodel.named_parameters():
            _close(p.grad.full_tensor(), reference.get_parameter(name).grad, f"{where}: grad of {name}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return [list(program.state) for program in dmodel.pipeline.programs]


def _world() -> dict[str, list[list[str]]]:
    torch.manual_seed(0)
    model, args, _ = HANDWRITTEN["reference-llama"]()
    reference = HANDWRITTEN["reference-llama"]()[0]
    states = {"reference-llama": _train(model, reference, args, autopar.Pipeline(2))}
    torch.manual_seed(0)
    model, args = _table_per_layer(n_layers=4)
    reference = _table_per_layer(n_layers=4)[0]
    states["table per layer"] = _train(model, reference, args, autopar.Pipeline(2, "interleaved-1f1b", 2))
    return states


@pytest.mark.distributed
def test_pipelines_reading_a_rotary_buffer_train_as_one_device():
    """The reference Llama (its table sliced once, the slice sent along) on 2 stages, and the
    same model slicing the table in every layer on 4 stages (2 per rank), each stage program
    taking its own copy: loss and gradients equal one device's for two SGD steps."""
    ranks = spawn(_world, 2)
    for pp, rank in enumerate(ranks):
        # the reference's table lives in stage 0 only, which slices it
        assert [REFERENCE_TABLE in state for state in rank["reference-llama"]] == [pp == 0]
        assert [TABLE in state for state in rank["table per layer"]] == [True, True]
