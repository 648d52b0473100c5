"""The example inputs a model is captured with, checked where export would not say what is wrong.

A plan is made for the example's shapes and, where the example holds real values, for what one
device would compute on them. Export runs the model on fake tensors, which have no values and do
not check every argument, so four mistakes would plan without a word or end in torch's words:

* an input with an empty dim (a batch of size 0): nothing to split, nothing to price;
* ``None`` (or a number) where the model's forward hands the input to an op that needs a tensor
  (``None`` is legal where the forward accepts it: only a failed capture is explained so);
* ids outside a lookup table (an embedding of 200 rows given id 200): one device raises
  ``IndexError``, a plan would be made for them;
* an example in another dtype than the model's (float64 or int64 inputs to a float32 model):
  one device refuses a matrix product of two dtypes, fake tensors do not.

Each is named by :func:`input_labels`: ``input 'x' (position 0)``, ``input 'labels'``, or a leaf
inside a container, ``input 'batch' (position 0)[1]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.ir.errors import OptionError
from autopar.ir.fake import is_fake
from autopar.ir.meta import module_path
from autopar.ir.ops import LAYOUT_CONSTRAINT

aten = torch.ops.aten

# ops whose result holds exactly the values of their first operand (reshaped, cast, copied)
_SAME_VALUES = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.flatten.using_ints,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.alias.default,
        aten.detach.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten._to_copy.default,
        aten.to.dtype,
    }
)


def input_labels(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Each leaf of ``(args, kwargs)``, in pytree order, with how messages name it.

    Args:
        model: the model whose ``forward`` names the positional inputs.
        args: the positional example inputs.
        kwargs: the keyword example inputs.
    """
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a signature Python can read
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    tops = [
        (f"input {positional[i]!r} (position {i})" if i < len(positional) else f"input at position {i}", v)
        for i, v in enumerate(args)
    ]
    tops += [(f"input {k!r}", v) for k, v in kwargs.items()]
    labelled = []
    for label, value in tops:
        leaves, _ = pytree.tree_flatten_with_path(value)
        labelled += [(label + pytree.keystr(path), leaf) for path, leaf in leaves]
    return labelled


def check_shapes(labelled: list[tuple[str, Any]]) -> None:
    """Refuse a tensor input with an empty dim: a plan is for the example's shapes, and a batch
    of size 0 has nothing to split or price.

    Args:
        labelled: the inputs as :func:`input_labels` gives them.
    """
    for label, value in labelled:
        if isinstance(value, torch.Tensor) and 0 in value.shape:
            d = list(value.shape).index(0)
            raise OptionError(
                f"example {label} has shape {tuple(value.shape)}: dim {d} is empty (size 0); a plan is "
                f"made for the example's shapes, so give at least one item along every dim"
            )


def non_tensor_hint(labelled: list[tuple[str, Any]], error: BaseException) -> str | None:
    """Why a capture failed where an op was given something other than a tensor (``error`` says
    ``not NoneType``, ``not int``): the example inputs of that type, to give as tensors; else None."""
    wrong = [
        label
        for label, value in labelled
        if not isinstance(value, torch.Tensor) and f"not {type(value).__name__}" in str(error)
    ]
    if not wrong:
        return None
    kind = type(dict(labelled)[wrong[0]]).__name__
    return (
        f"give a tensor for example {' and '.join(wrong)}: the model's forward hands "
        f"{'it' if len(wrong) == 1 else 'them'} to an op that needs a tensor, not {kind} (a "
        f"{kind} is fine only where the forward accepts one)"
    )


def _placeholders(
    program: torch.export.ExportedProgram, model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]
) -> dict[str, tuple[str, Any]]:
    """Each user input placeholder of ``program`` with its label and example value (none where
    the inputs cannot be matched to the placeholders)."""
    in_spec = program.call_spec.in_spec
    keys = in_spec.child(1).context if in_spec is not None and in_spec.num_children == 2 else []
    labelled = input_labels(model, args, {k: kwargs[k] for k in keys if k in kwargs})
    names = program.graph_signature.user_inputs
    return dict(zip(names, labelled)) if len(labelled) == len(names) else {}


def _source(node: Any) -> Any:
    """The value ``node`` holds the values of: itself, or what views, casts, copies and layout
    constraints (the free points at block inputs) took them from."""
    while isinstance(node, torch.fx.Node) and (
        node.target in _SAME_VALUES or str(node.target) == LAYOUT_CONSTRAINT
    ):
        node = node.args[0]
    return node


def check_values(
    program: torch.export.ExportedProgram, model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]
) -> None:
    """Refuse what one device would refuse but fake tensors let through: example ids outside the
    table an embedding looks them up in (``IndexError``), where the example holds real values (meta
    inputs hold none), and operands of a matrix product in different dtypes (a float64 or int64
    example for a float32 model).

    Args:
        program: ``model`` exported; its embeddings' ids are followed back to user inputs through
            ops that keep every value (views, casts, copies).
        model: the model, whose ``forward`` names the inputs.
        args: the positional example inputs, as exported.
        kwargs: the keyword example inputs, as exported.
    """
    inputs = _placeholders(program, model, args, kwargs)
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _PRODUCTS:
            _check_dtypes(node, inputs)
        if node.target is not aten.embedding.default:
            continue
        source = _source(node.args[1])
        label, ids = inputs.get(getattr(source, "name", None), (None, None))
        if not isinstance(ids, torch.Tensor) or ids.is_meta or is_fake(ids) or ids.is_floating_point():
            continue
        if not ids.numel():
            continue
        rows = node.args[0].meta["val"].shape[0]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= rows:
            raise OptionError(
                f"example {label} holds id {low if low < 0 else high}, but module "
                f"'{module_path(node) or '<root>'}' looks it up in a table of {rows} rows: ids must be in "
                f"[0, {rows}), where one device would raise IndexError"
            )


# matrix products, whose tensor operands one device requires in one dtype
_PRODUCTS = frozenset(
    {
        aten.linear.default,
        aten.mm.default,
        aten.bmm.default,
        aten.matmul.default,
        aten.addmm.default,
        aten.baddbmm.default,
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv3d.default,
        aten.convolution.default,
    }
)


def _check_dtypes(node: torch.fx.Node, inputs: Mapping[str, tuple[str, Any]]) -> None:
    """One dtype among a matrix product's tensor operands, as one device requires (fake tensors do
    not); the example inputs the operands come from are named with their dtypes."""
    operands = [
        a for a in node.args if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]
    dtypes = [a.meta["val"].dtype for a in operands]
    if len(set(dtypes)) < 2:
        return
    sources = [s for a in operands if isinstance(s := _source(a), torch.fx.Node) and s.name in inputs]
    given = "".join(f" (example {inputs[s.name][0]} is {s.meta['val'].dtype})" for s in sources)
    raise OptionError(
        f"op {node.target} in module '{module_path(node) or '<root>'}' computes on operands of dtypes "
        f"{', '.join(str(d) for d in dtypes)}{given}, which one device refuses (a product takes one dtype): "
        "give the example inputs in the model's dtype"
    )
