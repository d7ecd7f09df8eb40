#!/usr/bin/env python3
"""The Chrome traces of `conveyor schedule --trace` and `conveyor train --trace` draw each
thread's slices one after the other: read exactly (as decimals, not floating point), no slice
starts before the one before it on its (pid, tid) has ended, none starts before 0 or lasts
less than 0, and every time is a whole number of nanoseconds, the resolution Perfetto reads
them at. A start and duration computed each in floating point put a slice that ends where
the next begins past it (ts 1048574.999999999 dur 125, next at 1048699.9999999988), and
viewers nest or move slices that overlap.

Usage: trace_slices_check.py CONVEYOR WORKDIR     runs the cases below
       trace_slices_check.py --check TRACE...     checks traces already written"""
import json
import shutil
import subprocess
import sys
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

TINY = ["--device", "cpu", "--d-model", "8", "--hidden", "16", "--vocab", "16", "--steps", "2",
        "--quiet"]
# Costs of a tenth, whose sums carry rounding noise; measured steps and their simulation, of a
# split backward and of replicas with all-reduces.
CASES = [
    ("interleaved", ["schedule", "--kind", "interleaved", "-p", "4", "-m", "16", "-v", "2",
                     "--costs", "1,1,1,0.1"]),
    ("zbh1", ["schedule", "--kind", "zbh1", "-p", "4", "-m", "8", "--costs", "0.3,0.2,0.1,0.1"]),
    ("train_zbh1", ["train", *TINY, "--stages", "4", "--layers", "4", "--microbatches", "16",
                    "--batch-tokens", "64", "--schedule", "zbh1"]),
    ("train_dp", ["train", *TINY, "--stages", "2", "--layers", "2", "--dp", "2",
                  "--microbatches", "8", "--batch-tokens", "64"]),
]


def fail(message):
    print(f"trace_slices_check: {message}", file=sys.stderr)
    sys.exit(1)


def check(path):
    doc = json.loads(Path(path).read_text(), parse_float=Decimal)
    threads = defaultdict(list)
    for e in doc["traceEvents"]:
        for key in ("ts", "dur"):
            if key in e and (Decimal(e[key]) * 1000) % 1 != 0:
                fail(f"{path}: {e['name']} has {key} {e[key]} us, not whole nanoseconds")
        if e.get("ph") != "X":
            continue
        if e["ts"] < 0 or e["dur"] < 0:
            fail(f"{path}: {e['name']} on pid {e['pid']} starts at {e['ts']} us and lasts "
                 f"{e['dur']} us")
        threads[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    if not threads:
        fail(f"{path}: no slices")
    overlaps = []
    for (pid, tid), slices in threads.items():
        slices.sort()
        end, last = None, None
        for begin, finish, name in slices:
            if end is not None and begin < end:
                overlaps.append(f"pid {pid} tid {tid}: {name} starts at {begin} us, before "
                                f"{last} ends at {end} us")
            if end is None or finish > end:
                end, last = finish, name
    if overlaps:
        fail(f"{path}: {len(overlaps)} slices overlap the one before on their thread, e.g. "
             + "; ".join(overlaps[:3]))
    return sum(len(s) for s in threads.values())


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--check":
        for path in sys.argv[2:]:
            check(path)
        print("trace_slices_check: ok")
        return
    conveyor, work = sys.argv[1], Path(sys.argv[2])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name, args in CASES:
        trace = work / f"{name}.json"
        cmd = [conveyor, *args, "--trace", str(trace)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            fail(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
        slices = check(trace)
        print(f"{name}: {slices} slices, none overlapping")
    print("trace_slices_check: ok")


if __name__ == "__main__":
    main()
