"""Measure this host for the ``cpu-gloo`` cluster preset.

Usage, from the repository root::

    python bench/calibrate_cpu_gloo.py [--world-size 2] [--json out.json]

Takes under a minute on an idle host. Prints the measured constants, what the fitted
ring model predicts for a few all_reduce sizes, and the cluster as JSON. Paste the
numbers into the ``"cpu-gloo"`` preset in ``autopar/planning/cost/model.py`` (with the date and
machine) to change the planner's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Run as a plain script from a checkout: make the repository importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.ir.mesh import MeshSpec  # noqa: E402
from autopar.planning.cost.model import Collective, CostModel  # noqa: E402
from autopar.tools.calibrate import measure_cpu_gloo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn on this host")
    parser.add_argument("--json", type=Path, help="also write the cluster as JSON here")
    args = parser.parse_args()

    if os.getloadavg()[0] > 0.5:
        # Other work on the cores shows up as slower compute and collectives.
        print(f"warning: load average {os.getloadavg()[0]:.2f}; the host should be idle", file=sys.stderr)
    cluster = measure_cpu_gloo(args.world_size)
    for dtype, flops in cluster.peak_flops.items():
        print(f"matmul {dtype:>9}: {flops / 1e9:8.1f} GFLOP/s per rank")
    print(f"memory bandwidth : {cluster.memory_bandwidth_Bps / 1e9:8.2f} GB/s per rank")
    print(f"memory per rank  : {cluster.memory_bytes / 2**30:8.2f} GiB")
    print(f"op overhead      : {cluster.op_overhead_s * 1e6:8.2f} us per op")
    print(f"stragglers       : {cluster.straggler_s * 1e3:8.2f} ms waited after 1 s of compute")
    print(f"ranks per core   : {cluster.ranks_per_core:8.2f}")
    link = cluster.intra_node
    print(f"gloo link        : alpha {link.latency_s * 1e6:.1f} us, beta {link.bandwidth_Bps / 1e9:.3f} GB/s")

    # What the fitted ring model predicts, to compare with the timings gloo users see.
    model = CostModel(MeshSpec(("x",), (args.world_size,)), cluster)
    for nbytes in (1 << 10, 1 << 20, 1 << 26):
        predicted = model.collective_time(Collective("all_reduce", ("x",), nbytes))
        print(f"  model all_reduce {nbytes:>10} B: {predicted * 1e3:9.3f} ms")

    text = json.dumps(cluster.to_dict(), indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
