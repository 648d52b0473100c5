"""Calibration of one accelerator: ``autopar calibrate --device cuda`` (:func:`measure_device`).

One device has no collectives to time, so a cluster of one device takes its links (and the
figures a link carries, such as the devices per node) from a preset, ``h100`` unless told
otherwise, and measures everything a rank computes with: products per dtype, memory bandwidth,
exp and the other functions, the per-op overhead and a recompute region's, the optimizer's
per-tensor cost, the device memory, and under optimizer offload the host: its copies both ways,
its memory bandwidth and its per-op overhead. A GPU queues kernels ahead of their execution, so
its cluster is ``asynchronous`` (``autopar/planning/cost/step_overheads.py``).

Multi-device meshes are then planned with the preset's links: their fidelity is the preset's.
"""

from __future__ import annotations

import dataclasses

import torch

from autopar.ir.errors import OptionError
from autopar.ir.options import dtype_name
from autopar.planning.cost.model import Cluster, get_cluster, this_machine
from autopar.tools import rank_speed
from autopar.tools.launch import spawn

#: The preset a device's links come from, by device type, unless one is named.
LINKS_FROM = {"cuda": "h100", "cpu": "cpu-gloo"}


def check_device(device: str) -> torch.device:
    """``device`` as a torch device that this process can compute on, or an :class:`OptionError`."""
    try:
        parsed = torch.device(device)
    except RuntimeError as e:
        raise OptionError(f"--device {device!r} is not a torch device such as cuda or cuda:1 ({e})") from None
    if parsed.type not in LINKS_FROM:
        raise OptionError(f"--device {device!r}: calibrate times {' or '.join(LINKS_FROM)} devices")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"--device {device!r}: this machine has no CUDA device")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise OptionError(
                f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return parsed


def measure_device(device: str, links: str | None = None) -> tuple[Cluster, list[str]]:
    """This host's ``device`` timed into a cluster named ``calibrated`` with the links of the
    preset ``links`` (by default :data:`LINKS_FROM` its type's), and notes on what was not
    measured. Times in a spawned world of one rank (NCCL on a GPU, gloo on the CPU), as a
    rank of a run computes; takes about half a minute."""
    place = check_device(device)
    base = get_cluster(links or LINKS_FROM[place.type])
    timed = spawn(_timed, 1, str(place), base.to_dict(), backend="gloo" if place.type == "cpu" else "nccl")[0]
    cluster = Cluster.from_dict(timed)
    notes = [
        f"one device has no collectives to time: the links, devices per node and stragglers are the "
        f"{base.name} preset's; calibrate a world of ranks (--ranks, or torchrun) to measure them"
    ]
    return cluster, notes


def _timed(device: str, preset: dict) -> dict:
    # a Cluster's frozen mappings do not pickle: it crosses to the rank and back as a dict
    return device_cluster(device, Cluster.from_dict(preset)).to_dict()


def device_cluster(device: str, base: Cluster) -> Cluster:
    """``base`` with everything one rank computes with timed on ``device``, named ``calibrated``.

    Runs on a rank of an initialised process group (every rank times at once, see
    :mod:`autopar.tools.rank_speed`), its default device ``device``.
    """
    place = torch.device(device)
    if place.type == "cuda":
        torch.cuda.set_device(place)
    bandwidth = rank_speed.memory_bandwidth(device)
    accelerated = place.type != "cpu"
    memory = torch.cuda.get_device_properties(place).total_memory if accelerated else base.memory_bytes
    peaks = {dtype_name(d): rank_speed.matmul_flops(d, device) for d in rank_speed.MEASURED_DTYPES}
    return dataclasses.replace(
        base,
        name="calibrated",
        measured_on=this_machine(),
        peak_flops=peaks,
        memory_bandwidth_Bps=bandwidth,
        memory_bytes=memory,
        op_overhead_s=rank_speed.op_overhead(device),
        recompute_unit_s=rank_speed.recompute_overhead(device),
        checkpoint_unit_s=rank_speed.recompute_overhead(device, selective=False),
        asynchronous=accelerated,
        host_link_Bps=rank_speed.host_link(device) if accelerated else base.host_link_Bps,
        host_memory_bandwidth_Bps=rank_speed.memory_bandwidth("cpu") if accelerated else None,
        host_op_overhead_s=rank_speed.op_overhead("cpu") if accelerated else None,
        optimizer_tensor_s=rank_speed.optimizer_tensor(bandwidth, device),
        transcendentals_per_s=rank_speed.transcendentals(device),
        function_rates=rank_speed.function_rates(device),
        attention=rank_speed.attention_rates(rank_speed.attention_times(device), peaks["float32"], device),
    )


def device_report(cluster: Cluster, device: str) -> list[str]:
    """What :func:`measure_device` measured, one line for ``autopar calibrate`` to print."""
    flops = ", ".join(f"{d} {f / 1e12:.2f}" for d, f in cluster.peak_flops.items())
    host = ""
    if cluster.host_op_overhead_s is not None and cluster.host_link_Bps:
        host = (
            f"; host copies {cluster.host_link_Bps / 1e9:.1f} GB/s, "
            f"host op {cluster.host_op_overhead_s * 1e6:.1f} us"
        )
    return [
        f"{device} on {cluster.measured_on}: TFLOP/s {flops}; "
        f"memory {cluster.memory_bandwidth_Bps / 1e9:.0f} GB/s, "
        f"{cluster.memory_bytes / 2**30:.1f} GiB; {cluster.op_overhead_s * 1e6:.1f} us per op "
        f"({'queued ahead of the compute' if cluster.asynchronous else 'synchronous'}), "
        f"{(cluster.recompute_unit_s or 0) * 1e6:.0f} us per unit of a recompute region (an op or a "
        f"tensor it saves; {(cluster.checkpoint_unit_s or 0) * 1e6:.0f} us without collectives){host}; "
        f"{cluster.attention.describe() if cluster.attention else 'attention not timed'}"
    ]
