#!/usr/bin/env python3
"""`conveyor train --trace` draws the simulated last step next to the measured one: one
process "simulated rank r" per pipeline rank (replica 0's under --dp), sorted after every
measured rank, from the same time origin, with the measured step's actions; each rank's
simulated compute time is its measured compute time (the simulator's costs are the measured
means per stage and kind), every simulated transfer takes the mean measured message time, and
the simulated makespan gives the printed simulated bubble and idle shares. A one-stage run
prints no simulated figures and its trace holds no simulated process.

Usage: simulated_trace_check.py CONVEYOR WORKDIR          runs the cases below
       simulated_trace_check.py --check TRACE OUTPUT P    checks one run's trace (P pipeline
                                                          ranks) against its printed output"""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

RUN_PID, SIMULATED_PID = 1000000, 2000000
COMPUTE, SEND, RECV = 0, 1, 2
SMALL = ["--device", "cpu", "--steps", "2", "--vocab", "32", "--d-model", "32", "--quiet"]
# (name, flags, pipeline ranks): stages that differ (an uneven partition), a split backward
# (I and W), and replicas with their all-reduces.
CASES = [
    ("1f1b", ["--stages", "2", "--microbatches", "4", "--batch-tokens", "512"], 2),
    ("zbh1_uneven", ["--stages", "3", "--layers", "6", "--partition", "1,2,3", "--schedule",
                     "zbh1", "--microbatches", "6", "--batch-tokens", "768"], 3),
    ("dp", ["--stages", "2", "--dp", "2", "--microbatches", "4", "--batch-tokens", "512"], 2),
]


def fail(message):
    print(f"simulated_trace_check: {message}", file=sys.stderr)
    sys.exit(1)


def close(a, b, tol, slack=0.0):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b)) + slack


# The trace writes each start and end to the nearest nanosecond: a duration is within 1 ns
# of the time it stands for.
NS = 1e-3


def run(conveyor, work, name, flags):
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    trace = folder / "trace.json"
    cmd = [conveyor, "train", *SMALL, *flags, "--trace", str(trace)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        fail(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return trace, done.stdout


def printed_simulation(output):
    """The printed simulated bubble and per-rank simulated idle shares."""
    line = next((l for l in output.splitlines() if l.startswith("bubble last step:")), None)
    if line is None:
        fail(f"no bubble line printed: {output}")
    bubble = re.search(r"simulated ([0-9.]+) \|", line)
    idle = re.findall(r" r([0-9]+) [0-9.]+ \(([0-9.]+)\)", line)
    if not bubble or not idle:
        fail(f"cannot read the simulated figures of: {line}")
    return float(bubble.group(1)), {int(r): float(v) for r, v in idle}


def check(trace_path, output, P):
    doc = json.loads(Path(trace_path).read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events
            if e.get("name") == "process_sort_index"}
    simulated = sorted(p for p in names if p >= SIMULATED_PID)
    if [names[p] for p in simulated] != [f"simulated rank {r}" for r in range(P)] or \
            simulated != [SIMULATED_PID + r for r in range(P)]:
        fail(f"expected processes 'simulated rank 0..{P - 1}' at pids {SIMULATED_PID}.., got "
             f"{[(p, names[p]) for p in simulated]}")
    measured = [p for p in names if p < RUN_PID]
    if min(sort[p] for p in simulated) <= max(sort[p] for p in measured):
        fail(f"the simulated ranks do not sort after the measured ones: {sort}")
    if "simulated_last_step" not in doc["otherData"]:
        fail(f"otherData has no simulated_last_step: {doc['otherData']}")

    # Each X event with the flow event the writer puts right after a transfer's slice.
    slices, flow = [], {}
    for e in events:
        if e.get("ph") == "X" and e["pid"] != RUN_PID:
            slices.append(e)
        elif e.get("ph") in ("s", "f"):
            flow[id(slices[-1])] = e["id"]
    sim_ids = {flow[id(e)] for e in slices if id(e) in flow and e["pid"] >= SIMULATED_PID}
    measured_ids = {flow[id(e)] for e in slices if id(e) in flow and e["pid"] < RUN_PID}
    if sim_ids & measured_ids:
        fail(f"simulated and measured arrows share flow ids {sorted(sim_ids & measured_ids)[:5]}")

    origin = min(e["ts"] for e in slices if e["pid"] < RUN_PID)
    sim_start = min(e["ts"] for e in slices if e["pid"] >= SIMULATED_PID)
    if not close(origin, sim_start, 1e-9):
        fail(f"the simulated step starts at {sim_start} us, the measured one at {origin} us")
    makespan = max(e["ts"] + e["dur"] for e in slices if e["pid"] >= SIMULATED_PID) - origin

    # Replica 0's measured messages, each from when both ends had started to when both had
    # ended: their mean is the simulator's cost of every transfer.
    ends = {}
    for e in slices:
        if e["pid"] < P and id(e) in flow:
            ends.setdefault(flow[id(e)], []).append((e["ts"], e["ts"] + e["dur"]))
    messages = [max(b for _, b in ab) - max(a for a, _ in ab) for ab in ends.values()]
    latency = sum(messages) / len(messages)

    busy = {}
    for r in range(P):
        mine = [e for e in slices if e["pid"] == r]
        sim = [e for e in slices if e["pid"] == SIMULATED_PID + r]
        if sorted(e["name"] for e in mine) != sorted(e["name"] for e in sim):
            fail(f"simulated rank {r} runs {sorted(e['name'] for e in sim)}, measured rank {r} "
                 f"{sorted(e['name'] for e in mine)}")
        measured_busy = sum(e["dur"] for e in mine if e["tid"] == COMPUTE)
        busy[r] = sum(e["dur"] for e in sim if e["tid"] == COMPUTE)
        if not close(busy[r], measured_busy, 1e-9, 2 * NS * len(mine)):
            fail(f"simulated rank {r} computes {busy[r]} us, measured rank {r} {measured_busy} us")
        for e in sim:
            if e["tid"] in (SEND, RECV) and not close(e["dur"], latency, 1e-6, 2 * NS):
                fail(f"simulated {e['name']} takes {e['dur']} us, the mean measured message "
                     f"{latency} us")
    bubble = 1 - sum(busy.values()) / (P * makespan)
    printed, idle = printed_simulation(output)
    if abs(bubble - printed) > 0.0005 + 1e-9:
        fail(f"the simulated timeline's bubble is {bubble:.6f} (makespan {makespan} us), "
             f"printed {printed}")
    for r in range(P):
        share = 1 - busy[r] / makespan
        if abs(share - idle[r]) > 0.0005 + 1e-9:
            fail(f"simulated rank {r} idles {share:.6f} of the step, printed {idle[r]}")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--check":
        check(sys.argv[2], Path(sys.argv[3]).read_text(), int(sys.argv[4]))
        print("simulated_trace_check: ok")
        return
    conveyor, work = sys.argv[1], Path(sys.argv[2])
    for name, flags, P in CASES:
        trace, output = run(conveyor, work, name, flags)
        check(trace, output, P)
    # One stage: no simulated figures printed, none claimed in the trace.
    trace, output = run(conveyor, work, "one_stage", ["--batch-tokens", "512"])
    doc = json.loads(trace.read_text())
    if re.search(r"^bubble", output, re.M) or "simulation under the measured" in output or \
            "simulated_last_step" in doc["otherData"] or \
            any(e.get("pid", 0) >= SIMULATED_PID for e in doc["traceEvents"]):
        fail(f"a one-stage run claims a simulation: {output}")
    print("simulated_trace_check: ok")


if __name__ == "__main__":
    main()
