"""Create the program's tensors on this rank's device.

``torch.export`` records the device a factory creates its tensor on (``arange(32,
device=cpu)``, from ``torch.arange(n, device=idx.device)``) and the target of a copy
(``_to_copy(x, device=cpu)``) as they were for the example inputs: a model captured on the CPU
or on ``meta`` and run on a GPU mesh would compute those tensors on the capture device, and the
first op mixing them with the rank's tensors fails. The compiled program computes on one device,
the rank's (``ctx.device``): every ``device`` keyword argument in the graph is set to it.

Reads: nothing. Writes: nothing (the nodes' ``device`` keyword arguments).
"""

from __future__ import annotations

import torch

from autopar.passes.context import PassContext


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        device = node.kwargs.get("device")
        if node.op == "call_function" and device is not None and torch.device(device) != ctx.device:
            node.update_kwarg("device", ctx.device)
    return gm
