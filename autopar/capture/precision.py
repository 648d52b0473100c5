"""Mixed precision at capture: the model traced in the compute dtype, its state kept in its own.

Under :class:`~autopar.ir.options.MixedPrecision`, :func:`traced_in` runs the export with
every floating parameter swapped for an empty one of ``param_dtype`` (tied parameters stay
one), a pre-hook casting the floating inputs to it and a hook casting the floating outputs to
``output_dtype``: the model's own code sees the compute dtype, as under FSDP2 (``x.to(
self.weight.dtype)``, a norm that computes in fp32 and casts back to its input's dtype), and
the input and output casts are ops of the graph. :func:`cast_parameters` then gives each
parameter placeholder its own dtype back and inserts, before each op reading it, a cast to
``param_dtype`` (in that op's module and stage): the program takes the master weights and
computes with their casts, and backward hands each master its gradient in its own dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.ir.meta import place_beside, set_value
from autopar.ir.options import MixedPrecision

_CAST = torch.ops.aten._to_copy.default


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree
    )


@contextlib.contextmanager
def traced_in(model: nn.Module, precision: MixedPrecision | None) -> Iterator[dict[str, torch.dtype]]:
    """Inside, ``model`` computes in ``precision.param_dtype`` (see the module docstring);
    yields each swapped parameter's own dtype by name. Everything is restored on exit."""
    if precision is None:
        yield {}
        return
    swapped: dict[int, nn.Parameter] = {}
    restore: list[tuple[nn.Module, str, nn.Parameter]] = []
    dtypes: dict[str, torch.dtype] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == precision.param_dtype:
                continue
            if id(p) not in swapped:
                empty = torch.empty_like(p, dtype=precision.param_dtype)
                swapped[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
            dtypes[f"{prefix}.{name}" if prefix else name] = p.dtype
            restore.append((module, name, p))
            module._parameters[name] = swapped[id(p)]
    inputs = model.register_forward_pre_hook(
        lambda _m, args, kwargs: _cast_floats((args, kwargs), precision.param_dtype), with_kwargs=True
    )
    outputs = model.register_forward_hook(lambda _m, _a, out: _cast_floats(out, precision.output_dtype))
    try:
        yield dtypes
    finally:
        inputs.remove()
        outputs.remove()
        for module, name, p in restore:
            module._parameters[name] = p


def cast_parameters(
    program: torch.export.ExportedProgram,
    model: nn.Module,
    dtypes: dict[str, torch.dtype],
    precision: MixedPrecision,
) -> None:
    """Each parameter placeholder traced in ``param_dtype`` takes its own dtype (``dtypes`` by
    parameter name) and each op reading it reads a cast to ``param_dtype`` inserted before it;
    the program's state is ``model``'s own parameters again."""
    program.state_dict.update({n: model.get_parameter(n) for n in dtypes if n in program.state_dict})
    params = program.graph_signature.inputs_to_parameters
    graph = program.graph
    for node in list(graph.nodes):
        if node.op != "placeholder" or params.get(node.name) not in dtypes:
            continue
        traced = node.meta["val"]
        with traced.fake_mode:
            dtype = dtypes[params[node.name]]
            own = torch.empty_strided(traced.shape, traced.stride(), dtype=dtype, device=traced.device)
        set_value(node, own.requires_grad_(traced.requires_grad))
        for user in list(node.users):
            with graph.inserting_before(user):
                cast = graph.call_function(_CAST, (node,), {"dtype": precision.param_dtype})
            set_value(cast, traced)
            place_beside(cast, user)
            user.replace_input_with(node, cast)
    graph.lint()
