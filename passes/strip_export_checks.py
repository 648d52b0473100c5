"""Remove export's runtime checks.

``torch.export`` records ``_assert_tensor_metadata`` and ``_assert_scalar`` checks of
the example inputs' global dtype/device/shape; per rank the tensors are local, so
the checks do not apply to the compiled program.

Reads: nothing. Writes: nothing (removes nodes without users).
"""

from __future__ import annotations

import torch

from autopar.passes.context import PassContext

CHECKS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"}


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and str(node.target) in CHECKS and not node.users:
            gm.graph.erase_node(node)
    return gm
