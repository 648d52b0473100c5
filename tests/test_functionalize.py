"""In-place ops on temporaries become out-of-place at capture (``autopar/capture/functionalize.py``);
in-place ops on inputs, buffers, views and values read through another view stay as they are."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.capture.functionalize import functionalize

aten = torch.ops.aten


def _exported(model: nn.Module, *args: torch.Tensor) -> tuple[torch.export.ExportedProgram, list[str]]:
    program = torch.export.export(model, args, strict=False)
    return program, [n.name for n in functionalize(program.graph_module)]


def _targets(program: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


class _Temporaries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        h.add_(self.b)
        h.mul_(2.0).relu_()
        g = h + 0.5
        g.masked_fill_(g > 2.5, 0.0).clamp_(max=2.0)
        return h.sum() + g.sum()


def test_in_place_ops_on_temporaries_become_out_of_place_with_eager_values_and_gradients():
    model = _Temporaries()
    x = torch.randn(4, 8, requires_grad=True)
    program, rewritten = _exported(copy.deepcopy(model), x)
    assert rewritten == ["add_", "mul_", "relu_", "masked_fill_", "clamp_"]
    assert not [t for t in _targets(program) if t.split(".")[1].endswith("_")]
    assert "aten.masked_fill.Scalar" in _targets(program)

    expected = model(x)
    want = torch.autograd.grad(expected, [x, model.w, model.b])
    replay = program.module()
    got = replay(x)
    grads = torch.autograd.grad(got, [x, replay.w, replay.b])
    torch.testing.assert_close(got, expected)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w)


class _Observed(nn.Module):
    """In-place updates whose effect is seen elsewhere: none may become out-of-place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, wide: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.steps.add_(1)  # a buffer: the caller sees the update
        h = x * 2
        h[0].mul_(3)  # through a view: h changes too
        k = x + 1
        flat = k.view(-1)
        k.mul_(2)  # flat, made before, is read after
        alias = x.float()  # may be x itself
        alias.add_(1)
        m = x - 1
        m.add_(wide)  # promotes to float64 out of place; in place it stays float32
        return h, flat, m


def test_updates_seen_through_inputs_views_or_dtype_stay_in_place():
    x, wide = torch.randn(4, 8), torch.randn(8, dtype=torch.float64)
    model = _Observed()
    program, rewritten = _exported(copy.deepcopy(model), x.clone(), wide)
    assert rewritten == []
    targets = _targets(program)
    assert targets.count("aten.add_.Tensor") == 3 and targets.count("aten.mul_.Tensor") == 2
    eager_x, graph_x = x.clone(), x.clone()
    expected = model(eager_x, wide)
    replay = program.module()
    got = replay(graph_x, wide)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(graph_x, eager_x)  # the input was updated in place too
    assert int(replay.steps) == int(model.steps) == 1


def test_a_chain_through_a_later_view_is_rewritten_and_the_view_write_kept():
    class ViewAfter(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            h.add_(1)  # no view of h exists yet: out of place
            h[:, 0].zero_()  # writes the new value through a view: stays
            return h

    x = torch.randn(4, 8)
    program, rewritten = _exported(ViewAfter(), x)
    assert rewritten == ["add_"]
    assert "aten.zero_.default" in _targets(program)
    torch.testing.assert_close(program.module()(x), ViewAfter()(x))


class _Block(nn.Module):
    """A ResNet basic block written as torchvision does: in-place ReLUs and ``out += identity``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def test_resnet_block_plans_its_in_place_ops_as_ordinary_ones(fake_process_group):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _Block(8), _Block(8))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    compiled = autopar.compile(model, mesh, (torch.randn(4, 3, 8, 8),), cluster="fast-links")
    warnings = "\n".join(compiled.plan.warnings)
    assert "aten.add_" not in warnings and "aten.relu_" not in warnings, warnings


def test_a_write_through_a_view_whose_base_is_dead_is_rewritten():
    """MobileNetV2's classifier: an in-place dropout of a flattened (viewed) pooled tensor."""

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pooled = torch.nn.functional.adaptive_avg_pool2d(x, 1)
            flat = torch.flatten(pooled, 1)
            return self.proj(torch.nn.functional.dropout(flat, 0.0, True, inplace=True).relu_()).sum()

    gm = torch.export.export(Head(), (torch.randn(2, 8, 3, 3),), strict=False).graph_module
    rewritten = functionalize(gm)
    assert {str(n.target) for n in rewritten} == {"aten.dropout.default", "aten.relu.default"}


def test_writes_into_slices_of_a_fresh_tensor_become_scatters():
    """T5's and BART's _shift_right: labels shifted right into a new tensor, start token first."""

    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 4)

        def forward(self, labels: torch.Tensor) -> torch.Tensor:
            shifted = labels.new_zeros(labels.shape)
            shifted[..., 1:] = labels[..., :-1].clone()
            shifted[..., 0] = 3
            shifted.masked_fill_(shifted == -100, 0)
            return self.embed(shifted).sum()

    model, labels = Shift(), torch.randint(0, 16, (2, 6))
    ep = torch.export.export(model, (labels,), strict=False)
    rewritten = functionalize(ep.graph_module)
    targets = {str(n.target) for n in rewritten}
    assert {"aten.slice_scatter.default", "aten.select_scatter.default", "aten.masked_fill.Scalar"} <= targets
    assert not [n for n in ep.graph.nodes if str(n.target).endswith("_.default") or "fill_" in str(n.target)]
    for batch in (labels, torch.randint(0, 16, (2, 6))):
        torch.testing.assert_close(ep.module()(batch), model(batch))
