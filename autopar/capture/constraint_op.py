"""The custom op ``autopar::layout_constraint`` and its ``spec`` string.

Annotated tensors pass through this op while a model is captured: run, it is a copy;
exported, it is a graph node (named :data:`autopar.ir.ops.LAYOUT_CONSTRAINT`) whose
``spec`` tells the planner the layout required there and where the requirement came from.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from autopar.ir.errors import AnnotationError
from autopar.ir.layout import Layout, format_layout, parse_layout


@torch.library.custom_op("autopar::layout_constraint", mutates_args=())
def layout_constraint(x: torch.Tensor, spec: str) -> torch.Tensor:
    """``x`` must have the layout in ``spec`` (JSON, see :func:`parse_constraint_spec`).

    Eagerly a copy: a custom op may not return its input. Exported, a node the planner reads.
    """
    return x.clone()


@layout_constraint.register_fake
def _layout_constraint_fake(x: torch.Tensor, spec: str) -> torch.Tensor:
    return torch.empty_like(x)


def _layout_constraint_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


layout_constraint.register_autograd(_layout_constraint_backward)


def constraint_spec(layout: Layout | None, origin: str) -> str:
    """The ``spec`` string of a ``layout_constraint`` node: ``{"layout": "S(0)R", "origin": ...}``.

    A ``None`` layout (JSON ``null``) pins nothing: it marks a point where the solver
    may change the layout freely (autopar puts one at the input of every repeated block).
    """
    return json.dumps({"layout": None if layout is None else format_layout(layout), "origin": origin})


def parse_constraint_spec(spec: str) -> tuple[Layout | None, str]:
    """Inverse of :func:`constraint_spec`: the layout (``None`` if free) and the description of its origin."""
    try:
        data = json.loads(spec)
        layout = None if data["layout"] is None else parse_layout(data["layout"])
        return layout, str(data["origin"])
    except (ValueError, KeyError, TypeError) as e:
        raise AnnotationError(f"not a layout_constraint spec: {spec!r} ({e})") from None
