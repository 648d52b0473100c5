"""Microbatches in flight on a pipeline rank, moment by moment, as torch's schedules run them.

A rank holds the activations of every microbatch a stage of it has run forward and not yet
backward. They peak right after a forward, so the moments after each forward are the ones that
bound its memory. Under an interleaved schedule a rank runs ``virtual_stages`` stages whose
counts rise and fall at different times (the first local stage fills first), so what the rank
holds at its peak is found by walking the schedule, not by adding each stage's own largest count.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.ir.options import Pipeline


def flight_moments(pipeline: Pipeline, p: int, rank: int) -> list[tuple[int, ...]]:
    """The moments that bound pipeline coordinate ``rank``'s activations: right after each of its
    forwards, the microbatches each of its ``virtual_stages`` stages holds (forwarded, not yet
    backwarded); with one stage per rank (GPipe, 1F1B), only the moment it holds the most.

    The order is that of ``torch/distributed/pipelining/schedules.py``, which the runtime runs:
    ``ScheduleGPipe`` runs every forward before any backward (``m`` held); ``Schedule1F1B``'s
    warm-up runs ``min(m, p - rank)`` forwards, then a backward before each forward, so never more
    are held. ``ScheduleInterleaved1F1B`` (``_get_warmup_ops``, ``_get_1f1b_rank_ops``) runs
    ``w = min((v - 1) m_r + 2 (p - 1 - rank), v m)`` warm-up forwards, ``m_r = m // max(1, m // p)``
    microbatches per round, then in its steady state a forward before each backward: step ``k``'s
    forward (``k < v m``) is on local stage ``(k // m_r) % v``, its backward (``k >= w``) on local
    stage ``v - 1 - ((k - w) // m_r) % v``. With ``m`` a multiple of ``p``, Megatron's count for the
    first rank follows: ``w + 1 = v p + p - 1`` microbatch-stages, ``p (1 + (p - 1) / (p v))``
    microbatches' worth of its layers.

    Args:
        pipeline: the schedule, microbatches and virtual stages.
        p: ranks on the pipeline axis.
        rank: the pipeline coordinate.
    """
    m, v = pipeline.microbatches, pipeline.virtual_stages
    if pipeline.schedule == "gpipe":
        return [(m,)]
    if pipeline.schedule == "1f1b":
        return [(min(m, p - rank),)]
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), v * m)
    held, moments = [0] * v, []
    for k in range(v * m + warmup):
        if k < v * m:
            held[(k // per_round) % v] += 1
            moments.append(tuple(held))
        if k >= warmup:
            held[v - 1 - ((k - warmup) // per_round) % v] -= 1
    return moments


def stage_flights(pipeline: Pipeline, p: int, activation_bytes: Sequence[float]) -> list[int]:
    """Per stage (stage ``s`` on rank ``s % p``), the microbatches it holds at the moment its rank
    holds the most activations, each stage's one microbatch holding ``activation_bytes[s]``: the
    first such moment of :func:`flight_moments`. A rank's stages' activations at its peak are then
    the sum of each stage's bytes times its count; with equal bytes the counts add up to
    :meth:`~autopar.ir.options.Pipeline.in_flight`.

    Args:
        pipeline: the schedule, microbatches and virtual stages.
        p: ranks on the pipeline axis.
        activation_bytes: per stage, in order, what one microbatch's forward keeps for backward.
    """
    flights = [0] * len(activation_bytes)
    for rank in range(p):
        mine = range(rank, len(activation_bytes), p)
        peak = max(
            flight_moments(pipeline, p, rank),
            key=lambda held: sum(n * activation_bytes[s] for n, s in zip(held, mine)),
        )
        for s, n in zip(mine, peak):
            flights[s] = n
    return flights
