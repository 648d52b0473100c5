"""Create the program's tensors on this rank's device.

``torch.export`` records the device a factory creates its tensor on (``arange(32,
device=cpu)``, from ``torch.arange(n, device=idx.device)``) and the target of a copy
(``to.device(x, cpu, ...)``, from ``x.to(idx.device)``, as transformers' models do) as they were
for the example inputs: a model captured on the CPU or on ``meta`` and run on a GPU mesh would
compute those tensors on the capture device, and the first op mixing them with the rank's
tensors fails. The compiled program computes on one device, the rank's (``ctx.device``): every
device in a node's arguments, positional or keyword, is set to it.

Reads: nothing. Writes: nothing (the devices in the nodes' arguments).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.node import map_aggregate

from autopar.passes.context import PassContext


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    def placed(a: Any) -> Any:
        return ctx.device if isinstance(a, torch.device) else a

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        node.args = map_aggregate(node.args, placed)
        device = node.kwargs.get("device")
        kwargs = map_aggregate(node.kwargs, placed)
        if isinstance(device, str):  # a device named by a string, not a torch.device
            kwargs = {**kwargs, "device": ctx.device}
        node.kwargs = kwargs
    return gm
