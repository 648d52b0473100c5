"""A small convolutional net, written by hand: a stem, two residual blocks with batch norm, a
pooled classifier. Its forward returns the loss and, as a Python number, the accuracy.

:func:`build` returns a model and a batch of 16x16 images with labels. Run under
``torchrun --nproc-per-node 4 examples/cnn.py``, it compiles the model on its first call
(no example inputs) for a mesh of 4 gloo ranks and trains it with SGD; batch norm keeps
the statistics of the whole batch whatever the plan splits. Run without ``torchrun``, it
prints the parameter count and the plan for a 4-rank mesh (no ranks needed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class SmallResNet(nn.Module):
    """Stem (conv, batch norm, ReLU, max pool), two residual blocks, average pool, linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block1 = Residual(16, 16, stride=1)
        self.block2 = Residual(16, 32, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(32, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = nn.functional.max_pool2d(self.stem(images), 2)
        h = self.block2(self.block1(h))
        logits = self.head(self.pool(h).flatten(1))
        accuracy = (logits.argmax(-1) == labels).float().mean().item()  # a Python number
        return {"loss": nn.functional.cross_entropy(logits, labels), "accuracy": accuracy}


class Residual(nn.Module):
    """conv-bn-relu, grouped conv-bn, plus the input (1x1 strided conv where the shape changes), in place."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 else nn.Conv2d(cin, cout, 1, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        out += identity
        return torch.relu(out)


def build(batch_size: int = 32, device: str | torch.device = "cpu") -> tuple[SmallResNet, tuple]:
    """The model and one batch ``(images, labels)`` of ``batch_size`` 16x16 RGB images."""
    with torch.device(device):
        model = SmallResNet()
        images, labels = torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,))
    return model, (images, labels)


def main() -> None:
    """The demo: ``torchrun --nproc-per-node 4 examples/cnn.py`` (see the module docstring)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    torch.manual_seed(0)
    model, batch = build()
    if "RANK" not in os.environ:
        print(f"SmallResNet: {sum(p.numel() for p in model.parameters()):,} parameters")
        print(autopar.plan(model, batch, {"dp": 4}, cluster="fast-links").summary())
        return
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    dmodel = autopar.compile(model, mesh, cluster="fast-links")  # compiled on its first call
    optimizer = None
    for step in range(5):
        torch.manual_seed(step)  # the same global batch on every rank
        _, (images, labels) = build()
        out = dmodel(images, labels)
        out["loss"].backward()
        optimizer = optimizer or torch.optim.SGD(dmodel.parameters(), lr=0.1)  # parameters exist now
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {out['loss'].item():.4f}, accuracy {out['accuracy']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
