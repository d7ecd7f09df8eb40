#!/usr/bin/env python3
"""bench_kernels_cpu states the ceiling its memory-bound kernels are compared to, and each
row's percent is its printed rate divided by that ceiling (one time base for both), so a
reader can recompute it.  Usage: kernel_bench_ceiling.py BENCH_KERNELS_CPU"""
import json
import re
import subprocess
import sys


def fail(message):
    print(f"kernel_bench_ceiling: {message}", file=sys.stderr)
    sys.exit(1)


run = subprocess.run(
    [sys.argv[1], "--benchmark_filter=gelu_forward|adamw", "--benchmark_min_time=0.05",
     "--benchmark_format=json"], capture_output=True, text=True, timeout=240)
if run.returncode != 0:
    fail(f"exit status {run.returncode}: {run.stderr}")
report = json.loads(run.stdout)
stated = report["context"].get("copy_ceiling")
if stated is None:
    fail("the context states no copy_ceiling")
match = re.match(r"([0-9.]+) GB/s \(memcpy of 64 MiB, read \+ write counted, best of 5, ", stated)
if not match:
    fail(f"copy_ceiling does not say its figure and how it was measured: {stated!r}")
ceiling = float(match.group(1)) * 1e9
rows = report["benchmarks"]
if len(rows) != 2:
    fail(f"expected the gelu_forward and adamw rows, got {[r['name'] for r in rows]}")
for row in rows:
    # The ceiling is printed to 4 significant digits or so: 1 % covers the rounding.
    want = 100.0 * row["B/s"] / ceiling
    if abs(row["pct_copy_bw"] - want) > 0.01 * want:
        fail(f"{row['name']}: pct_copy_bw {row['pct_copy_bw']:.2f} but B/s {row['B/s']:.4g} / "
             f"ceiling {ceiling:.4g} is {want:.2f} %")
    print(f"{row['name']}: {row['B/s'] / 1e9:.2f} GB/s = {row['pct_copy_bw']:.1f} % of {stated}")
