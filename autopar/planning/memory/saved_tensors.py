"""What autograd saves for backward, per op: predicted by running the op on fake tensors.

:func:`saved_by` (:mod:`autopar.planning.memory.model` sums it over a planned graph) asks torch itself:
each op is re-run on fake tensors (no memory) of its operands' shapes, dtypes and strides under
``torch.autograd.graph.saved_tensors_hooks``, and every tensor autograd packs is classified as one of
the op's operands, one of its outputs, or something else it made (layer-norm statistics, a dropout
mask, an attention logsumexp). Composite ops (``aten.linear``, ``aten.layer_norm``, ``aten.dropout``,
``aten.scaled_dot_product_attention``) decompose there exactly as they do eagerly, so their internal
saves are seen too. :func:`saved_locally` runs the op on one rank's pieces of its operands instead
(what a rank saves can depend on them: which of its operands are contiguous, how each is split).

The fake tensors live on the operands' device, not on ``meta``: composite ops pick their kernels by
device, and ``meta`` picks paths no real device runs (attention on ``meta`` takes the math path, which
saves the ``seq x seq`` weights; on CPU it takes the flash kernel, which saves a logsumexp). A graph
captured on ``meta`` is modelled as CPU, and so is one on an accelerator this process cannot use.

:class:`autopar.tools.activation_meter.ActivationMeter` measures the same thing on a real run; its
docstring says where the two can differ.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.ir.fake import fake_mode
from autopar.ir.meta import per_node, storage_ref
from autopar.ir.ops import is_selective_save
from autopar.rules import OpCall


@dataclass(frozen=True)
class SavedSpec:
    """What autograd keeps for the backward of one op call, at the shapes it ran on.

    ``inputs`` are indexes into ``OpCall.of(node).operands`` (an fx value passed at several operand
    positions is reported at its first), ``outputs`` indexes into the tensor leaves of
    ``node.meta["val"]``, and ``extra_bytes`` the bytes of the other tensors saved (whole storages,
    each counted once). A tensor saved as a view of an operand or output counts as that operand or
    output.
    """

    inputs: frozenset[int] = frozenset()
    outputs: frozenset[int] = frozenset()
    extra_bytes: int = 0
    # the outputs of the matrix products and attention the op runs inside (its decomposition:
    # attention's math path multiplies q by k first) that are neither its outputs nor saved: what
    # a selective recompute region keeps of it besides, whole storages, each counted once
    inner_product_bytes: int = 0
    # how many tensors autograd packs, a repeat counted each time: a checkpoint's hooks run once
    # for each (what a recompute region's op costs grows with them: Cluster.recompute_unit_s)
    packed: int = 0
    # whether its output is made before autograd packs the last tensor it saves: autograd packs
    # operands before an op runs and its outputs and statistics after (a layer norm's output
    # exists when its statistics are packed, a product's not when its operands are), so a
    # recomputation torch stops at this op's last pack holds its output only then
    output_before_last_pack: bool = False


#: specs by op, operand metadata, non-tensor arguments, device, grad flags and the pieces the
#: operands ran as (None: their global values); None where the op did not run.
_CACHE: dict[Hashable, SavedSpec | None] = {}


def saved_by(node: torch.fx.Node, grad_operands: Sequence[bool]) -> SavedSpec:
    """What autograd saves for ``node``'s backward when operand ``i`` requires grad iff ``grad_operands[i]``.

    Only ``call_function`` nodes whose target is an ``OpOverload`` save anything; other nodes
    (``getitem``, Python arithmetic on sizes), and calls where no floating operand requires grad,
    get an empty spec. ``grad_operands`` has one flag per ``OpCall.of(node).operands``. An op that
    cannot run on fake tensors (no fake kernel, a symbolic size from another trace) gets the
    conservative spec: every grad-requiring floating operand saved (once), no outputs, no extra bytes.
    Must be called outside any tracing or dispatch mode (it runs its own fake mode).
    """
    flags = _grad_flags(node, grad_operands)
    if flags is None:
        return SavedSpec()
    spec = _cached(node, flags, None)
    if spec is None:
        saved = frozenset(i for i, flag in enumerate(flags) if flag)
        return SavedSpec(saved, packed=len(saved))
    return spec


def measure_saved(graph: torch.fx.Graph, flows: Mapping[torch.fx.Node, bool]) -> None:
    """:func:`saved_by` for every op of ``graph``, gradients flowing where ``flows`` says (a
    capture's :func:`~autopar.capture.export.gradient_flow`), into this process's cache. The
    automatic mesh calls it on each capture before forking the processes that plan on it: each
    would otherwise measure the same ops again, its cache lost when it exits."""
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            saved_by(node, [bool(flows.get(a)) for a in OpCall.of(node).operands])


def saved_locally(
    node: torch.fx.Node,
    grad_operands: Sequence[bool],
    shapes: Sequence[tuple[int, ...]],
    fresh: Sequence[bool],
) -> SavedSpec | None:
    """:func:`saved_by` with operand ``i`` as one rank holds it: at ``shapes[i]``, contiguous where
    ``fresh[i]`` (a collective's output) and otherwise a piece of a tensor strided like its global
    value. What the rank's op saves, where the global figures cannot tell: torch's attention math
    path (a mask that needs a gradient) saves a copy of ``k`` split like ``k`` and weights split
    like ``q``, and saves ``v`` itself where ``v`` is contiguous but a copy of it where it is a
    transposed view. None where nothing saves (no operand needs a gradient) or the op cannot run
    so (its other arguments name global sizes)."""
    flags = _grad_flags(node, grad_operands)
    if flags is None:
        return None
    pieces = tuple((tuple(int(s) for s in shape), bool(f)) for shape, f in zip(shapes, fresh))
    return _cached(node, flags, pieces)


def _grad_flags(node: torch.fx.Node, grad_operands: Sequence[bool]) -> tuple[bool, ...] | None:
    """Which operands of ``node`` take a gradient (floating ones flagged); None where none does or
    the node is no op call autograd could save for."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    operands = OpCall.of(node).operands
    if len(grad_operands) != len(operands):
        raise ValueError(f"{node.name}: {len(grad_operands)} grad flags for {len(operands)} tensor operands")
    flags = tuple(bool(f) and _differentiable(a.meta["val"].dtype) for a, f in zip(operands, grad_operands))
    return flags if any(flags) else None


Pieces = tuple[tuple[tuple[int, ...], bool], ...]  # per operand: (shape, fresh: a collective's output)


def _cached(node: torch.fx.Node, flags: tuple[bool, ...], pieces: Pieces | None) -> SavedSpec | None:
    """:func:`_measure`'s spec, cached by call, flags and pieces; None where the op did not run."""
    known = _call_key(node)
    key = None if known is None else (known, flags, pieces)
    if key is not None and key in _CACHE:
        return _CACHE[key]
    try:
        spec = _measure(node, OpCall.of(node), flags, pieces)
    except Exception:  # noqa: BLE001 - any failure to run the op: the callers say what follows
        spec = None
    if key is not None:
        _CACHE[key] = spec
    return spec


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _device(call: OpCall) -> torch.device:
    """The device whose kernels decide how ``call``'s op decomposes (see the module docstring)."""
    # an accelerator op may take CPU scalars among its operands: the accelerator decides
    devices = [a.meta["val"].device for a in call.operands]
    device = next((d for d in devices if d.type != "cpu"), devices[0])
    backend = getattr(torch, device.type, None)
    # creating a fake tensor on a device this build lacks aborts the process, so never try
    if device.type not in ("cpu", "meta") and backend is not None and backend.is_available():
        return device
    return torch.device("cpu")


@per_node
def _call_key(node: torch.fx.Node) -> Hashable | None:
    """A hashable summary of everything but the grad flags that decides what the call saves, or
    None if there is none."""
    call = OpCall.of(node)
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    first = {}
    for i, a in enumerate(call.operands):
        first.setdefault(a, i)  # the same value twice (mul(x, x)) saves differently from two values

    def summary(leaf: object) -> object:
        if isinstance(leaf, torch.fx.Node):
            val = leaf.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("tensor", first[leaf], tuple(val.shape), val.stride(), val.dtype)
            return ("value", val)
        return leaf

    key = (node.target, str(spec), tuple(map(summary, leaves)), _device(call))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _measure(node: torch.fx.Node, call: OpCall, flags: tuple[bool, ...], pieces: Pieces | None) -> SavedSpec:
    """Run the op on fake operands (as ``pieces``, or their own values) and classify what autograd
    packs."""
    device = _device(call)
    requires, piece_of = {}, {}
    for i, (a, flag) in enumerate(zip(call.operands, flags)):
        requires[a] = requires.get(a, False) or flag
        piece_of.setdefault(a, None if pieces is None else pieces[i])
    with fake_mode(), torch.enable_grad():
        fakes = {a: _fake_operand(a.meta["val"], device, rg, piece_of[a]) for a, rg in requires.items()}
        args, kwargs = pytree.tree_map(
            lambda x: (fakes[x] if x in fakes else x.meta.get("val")) if isinstance(x, torch.fx.Node) else x,
            (node.args, node.kwargs),
        )
        packed: list[torch.Tensor] = []
        products = _InnerOps()
        made_at_pack = 0  # how many tensors the op's inner ops had made when the last was packed

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal made_at_pack
            packed.append(t)
            made_at_pack = len(products.made)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), products:
            result = node.target(*args, **kwargs)
    operands = [fakes[a] for a in call.operands]
    outputs = [v for v in pytree.tree_leaves(result) if isinstance(v, torch.Tensor)]
    inputs: set[int] = set()
    saved_outputs: set[int] = set()
    extra: dict[StorageWeakRef, int] = {}
    for t in packed:
        # operands first: an in-place op's or view op's output is its operand's storage
        i = _find(t, operands)
        if i is not None:
            inputs.add(i)
            continue
        j = _find(t, outputs)
        if j is not None:
            saved_outputs.add(j)
            continue
        extra[storage_ref(t)] = t.untyped_storage().nbytes()
    own = {storage_ref(t) for t in (*operands, *outputs, *packed)}  # counted above
    inner = {storage_ref(t): t.untyped_storage().nbytes() for t in products.outputs}
    inner_bytes = sum(n for ref, n in inner.items() if ref not in own)
    made_first = {storage_ref(t) for t in products.made[:made_at_pack]}
    return SavedSpec(
        frozenset(inputs),
        frozenset(saved_outputs),
        sum(extra.values()),
        inner_bytes,
        len(packed),
        any(storage_ref(t) in made_first for t in outputs),
    )


class _InnerOps(TorchDispatchMode):
    """Collects the outputs of the matrix products and attention ops dispatched inside a ``with``
    (:func:`autopar.ir.ops.is_selective_save`: the ops the selective recompute policy keeps), and
    in ``made`` every op's output tensors in the order they were made."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []
        self.made: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.made += tensors
        if is_selective_save(func):
            self.outputs += tensors
        return out


def _fake_operand(
    val: torch.Tensor,
    device: torch.device,
    requires_grad: bool,
    piece: tuple[tuple[int, ...], bool] | None = None,
) -> torch.Tensor:
    """A fresh fake tensor like ``val``: same shape, strides and dtype; its own storage. With a
    ``piece`` ``(shape, fresh)``: a tensor of that shape, contiguous where ``fresh`` or ``val``
    is (a rank's shard of a contiguous value is its own contiguous tensor), else the leading piece
    of that shape of a tensor strided like ``val`` (a shard of a transposed or sliced view is
    such a view of the rank's tensor).

    One that requires grad is made a non-leaf (a copy of a leaf), as activations are: autograd
    refuses in-place ops on leaves that require grad, and the graph may hold such ops.
    """
    shape, stride = [int(s) for s in val.shape], [int(s) for s in val.stride()]
    dense = piece is not None and (piece[1] or val.is_contiguous())
    if dense:
        shape = list(piece[0])
        stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    t = torch.empty_strided(shape, stride, dtype=val.dtype, device=device)
    if requires_grad:
        leaf = torch.empty_strided(shape, stride, dtype=val.dtype, device=device, requires_grad=True)
        t.copy_(leaf)
    if piece is not None and not dense:
        for dim, size in enumerate(piece[0]):
            t = t.narrow(dim, 0, size)
    return t


def _find(t: torch.Tensor, candidates: Sequence[torch.Tensor]) -> int | None:
    """Index of the first candidate ``t`` is, or is a view of (same storage), else None.

    Autograd packs an operand or output itself (identity holds), but a composite op saves the views
    its decomposition made (``linear`` saves ``weight.t()``), which only share the storage.
    """
    for i, c in enumerate(candidates):
        if t is c:
            return i
    storage = storage_ref(t)
    for i, c in enumerate(candidates):
        if storage_ref(c) == storage:
            return i
    return None
