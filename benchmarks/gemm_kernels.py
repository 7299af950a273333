"""What the "tuned" layout measures, as a table: `python -m benchmarks.gemm_kernels`.

For each shape of the target's bias-free projections and head, milliseconds per layer of each
kernel (plain, transposed, MKL-packed, oneDNN) at each row count, timed the way the layout times
them (faser.runner.tuned_linear.kernel_times: its layers in turn, kernels interleaved, medians),
and the kernel it would choose (*). Usage:
  python -m benchmarks.gemm_kernels [--model M] [--threads 2] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import print_table
from faser.engine.model_pair import resolve
from faser.models.loader import load_model
from faser.runner.tuned_linear import ROW_BUCKETS, kernel_times, streamed_layers
from faser.runner.weights import tunable_projections


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded target")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model = load_model(resolve(args.model, "target"), "cpu", "float32", 4096)
    groups: dict[tuple[int, int], list] = {}
    for lin in tunable_projections(model):
        groups.setdefault(tuple(lin.weight.shape), []).append(lin)
    records = []
    for shape, linears in groups.items():
        times = kernel_times(linears, ROW_BUCKETS, args.repeats)
        layers = len(streamed_layers(linears))
        rows = []
        for kernel in times[ROW_BUCKETS[0]]:
            cells = [
                f"{1e3 * t[kernel] / layers:.3f}" + ("*" if min(t, key=t.get) == kernel else "")
                for t in times.values()
            ]
            rows.append([kernel, *cells])
        print_table(f"weight {shape[0]}x{shape[1]}, ms per layer ({layers} layers in turn)",
                    ["kernel", *[f"{b} rows" for b in ROW_BUCKETS]], rows)
        records.append({"shape": list(shape), "layers_timed": layers,
                        "seconds_per_call": {str(b): t for b, t in times.items()}})
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
