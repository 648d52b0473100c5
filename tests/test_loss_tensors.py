"""A loss that holds tensors of its own (class weights, as ``nn.CrossEntropyLoss(weight=w)``'s buffer
or in a closure) compiles for ``train_step`` and equals one device: the loss is captured on fake
tensors of the ranks' device, not on meta. On 2 gloo ranks the batch is split over ``dp``, so the
weighted mean (over the weights of the targets, an ignored target left out) is taken across ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.tools.launch import spawn


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.classes = nn.Linear(8, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classes(torch.relu(self.hidden(x)))


def _losses(weight: torch.Tensor) -> dict[str, object]:
    return {
        "buffer": nn.CrossEntropyLoss(weight=weight),
        "closure": lambda out, target: F.cross_entropy(out, target, weight=weight, label_smoothing=0.1),
    }


def _weighted_losses_equal_one_device(sizes: tuple[int, ...]) -> dict[str, tuple[float, float, float]]:
    """Each loss's value on the ranks and on one device, and the largest gradient difference."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("dp",))
    torch.manual_seed(0)
    x, target, weight = torch.randn(8, 8), torch.randint(0, 10, (8,)), torch.rand(10) + 0.1
    target[3] = -100  # ignored: its weight counts in no mean
    found = {}
    for name, loss_fn in _losses(weight).items():
        torch.manual_seed(0)
        model = _Classifier()
        reference = copy.deepcopy(model)
        want = loss_fn(reference(x), target)
        want.backward()
        dmodel = autopar.compile(model, mesh, (x,), cluster="fast-links")
        got = dmodel.train_step(x, target, loss_fn)
        worst = max(
            float((p.grad.full_tensor() - reference.get_parameter(n).grad).abs().max())
            for n, p in dmodel.named_parameters()
        )
        found[name] = (got.item(), want.item(), worst)
    return found


def test_a_loss_holding_class_weights_compiles_on_one_rank():
    from autopar.tools.fake_ranks import fake_world

    with fake_world(1):
        found = _weighted_losses_equal_one_device((1,))
    for name, (got, want, worst) in found.items():
        assert got == pytest.approx(want, abs=1e-6) and worst < 1e-6, name


@pytest.mark.distributed
def test_a_weighted_loss_over_a_batch_split_on_2_gloo_ranks_equals_one_device():
    found = spawn(_weighted_losses_equal_one_device, 2, (2,))[0]
    for name, (got, want, worst) in found.items():
        assert got == pytest.approx(want, abs=1e-6) and worst < 1e-6, name
