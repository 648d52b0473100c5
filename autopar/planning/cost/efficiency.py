"""How a GPU's kernels run below the large-kernel rates of its cluster's figures: :class:`Efficiency`.

A :class:`~autopar.planning.cost.cluster.Cluster` of a GPU holds the rates its kernels reach at their
best (a large matrix product's FLOP/s, a streaming kernel's bytes per second, NCCL's bus bandwidth:
the presets' sources are in ``docs/cost_model.md``, "Presets"); its ``efficiency`` says how smaller or
other kernels fall below them, for :class:`~autopar.planning.cost.model.CostModel`:

* every kernel takes ``kernel_floor_s`` on the device besides its roofline time (a product's partial
  last wave, prologue and epilogue; any kernel's start), so a product of ``F`` flops runs at
  ``peak * F / (F + peak * kernel_floor_s)``: a small one far below a large one's rate;
* a fused attention kernel (flash attention) runs its products at ``attention_fraction`` of the
  product rate for long sequences at head dim 128, less at a smaller head dim (``d / (d + h)`` over
  its value at 128, ``h`` = ``attention_head_half``) and on a shorter sequence (``L / (L +
  attention_sequence_half)``).

A cluster without an efficiency (the CPU presets, ``autopar calibrate``'s files, whose figures were
timed at the sizes a step runs) prices every kernel at its figures, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.ir.arguments import check_keys, check_number
from autopar.ir.errors import OptionError

# Head dim at which ``Efficiency.attention_fraction`` is given: flash attention's best published figures.
ATTENTION_HEAD_DIM = 128
# Of the seven products flash attention's forward and backward run (two forward, five backward: the
# backward recomputes the scores), the rule counts six (the forward's two, the backward twice them).
ATTENTION_PRODUCTS = 7 / 6


@dataclass(frozen=True)
class Efficiency:
    """How far a GPU's kernels fall below the cluster's rates, by shape (see the module docstring).

    Every field is checked as given: a finite number in its range, else an
    :class:`~autopar.ir.errors.OptionError` naming the field and what it takes.
    """

    # Device seconds any kernel takes besides its roofline time: its start and, for a product, its
    # partial last wave, prologue and epilogue (below a millisecond: a kernel's floor, not a launch).
    kernel_floor_s: float
    # Fused attention's rate over the cluster's product rate for long sequences at head dim 128,
    # forward and backward (at most 1: its blocks are small products, and its softmax runs between them).
    attention_fraction: float
    attention_head_half: float = 32.0  # head dim at which attention runs at half a very wide head's rate
    attention_sequence_half: float = 256.0  # sequence length at which attention runs at half its rate

    def __post_init__(self) -> None:
        name = "Efficiency "
        check_number(self.kernel_floor_s, name + "kernel_floor_s", unit="seconds", inclusive=True, below=1e-3)
        check_number(self.attention_fraction, name + "attention_fraction", unit="of the product rate, <= 1")
        if self.attention_fraction > 1:
            raise OptionError(
                f"{name}attention_fraction is a fraction of the product rate, at most 1, got "
                f"{self.attention_fraction!r}"
            )
        for half, unit in (("attention_head_half", "a head dim"), ("attention_sequence_half", "positions")):
            check_number(getattr(self, half), name + half, unit=unit, inclusive=True)

    def arithmetic_s(self, flops: float, peak: float) -> float:
        """Seconds of ``flops`` products at ``peak`` FLOP/s, the kernel's floor included (none for no
        arithmetic: a view or a copy is priced by its bytes alone)."""
        return flops / peak + self.kernel_floor_s if flops else 0.0

    def attention_rate(self, head_dim: float, length: int) -> float:
        """The fraction of the product rate fused attention reaches at ``head_dim`` over a sequence of
        ``length`` positions (0: not known, priced as a long one)."""
        half = self.attention_head_half
        head = (head_dim / (head_dim + half)) / (ATTENTION_HEAD_DIM / (ATTENTION_HEAD_DIM + half))
        sequence = length / (length + self.attention_sequence_half) if length else 1.0
        return self.attention_fraction * min(1.0, head) * sequence

    def attention_s(self, flops: float, scores: float, causal_length: int, peak: float, grad: bool) -> float:
        """Seconds of one fused attention call: forward and backward where ``grad``, else a third (as the
        cost model splits every op). ``flops`` are the forward's products as the rule counts them over
        ``scores`` query-key pairs; under the implicit causal mask over ``causal_length`` positions the
        kernel computes half the pairs (the convention flash attention's published rates count in)."""
        head_dim = flops / (4 * scores) if scores else ATTENTION_HEAD_DIM
        computed = 0.5 if causal_length else 1.0
        rate = peak * self.attention_rate(head_dim, causal_length)
        both = ATTENTION_PRODUCTS * 3 * flops * computed / rate + 2 * self.kernel_floor_s
        return both if grad else both / 3

    def to_dict(self) -> dict[str, float]:
        """Plain JSON-ready dict; :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "efficiency") -> Efficiency:
        """The efficiency :meth:`to_dict` wrote; every error names ``where`` it was read."""
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        check_keys(data, where, {f.name for f in fields}, required=required)
        try:
            return cls(**data)
        except OptionError as e:
            raise OptionError(f"{where}: {e}") from None
