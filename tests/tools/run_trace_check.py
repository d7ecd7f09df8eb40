#!/usr/bin/env python3
"""`conveyor train --trace` with checkpoints: the trace holds every step on the training loop,
each save's hold of the loop, and its write — on a thread of its own with --async-save, where
it overlaps the steps that follow, on the loop between two steps otherwise — plus the last
step's ranks on the run's clock.  Usage: run_trace_check.py CONVEYOR WORKDIR"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

RUN_PID, LOOP, WRITER = 1000000, 0, 1
# A save every 2 steps: three of them with steps after them, each a chance to show overlap.
STEPS, EVERY = 8, 2


def fail(message):
    print(f"run_trace_check: {message}", file=sys.stderr)
    sys.exit(1)


def traced_run(conveyor, work, name, extra):
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    trace = folder / "trace.json"
    cmd = [conveyor, "train", "--device", "cpu", "--steps", str(STEPS), "--stages", "2",
           "--batch-tokens", "2048", "--microbatches", "4", "--vocab", "32", "--d-model", "32",
           "--quiet", "--save-dir", str(folder / "ckpt"), "--save-every", str(EVERY),
           "--trace", str(trace)] + extra
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        fail(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(trace.read_text())["traceEvents"]


def slices(events, tid, prefix):
    return {e["name"].split(" ", 1)[1]: (e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("pid") == RUN_PID and e["ph"] == "X" and e["tid"] == tid
            and e["name"].startswith(prefix)}


def check(events, asynchronous):
    steps = slices(events, LOOP, "step ")
    if sorted(steps, key=int) != [str(s) for s in range(1, STEPS + 1)]:
        fail(f"expected steps 1..{STEPS} on the training loop, got {sorted(steps)}")
    hold = slices(events, LOOP, "snapshot " if asynchronous else "save ")
    writes = slices(events, WRITER if asynchronous else LOOP, "write ")
    expected = sorted(f"step_{s}" for s in range(EVERY, STEPS + 1, EVERY))
    if sorted(hold) != expected or sorted(writes) != expected:
        fail(f"expected holds and writes of {expected}, got {sorted(hold)} and {sorted(writes)}")
    for name, (begin, end) in hold.items():
        step = int(name.split("_")[1])
        if begin < steps[str(step)][1]:
            fail(f"the save of {name} holds the loop before step {step} ends")
        if step < STEPS and end > steps[str(step + 1)][0]:
            fail(f"the save of {name} still holds the loop when step {step + 1} begins")
    for name, (begin, end) in writes.items():
        if not hold[name][0] <= begin <= end:
            fail(f"the write of {name} is not after its hold begins")
    if asynchronous and slices(events, LOOP, "write "):
        fail("an async save wrote on the training loop")
    if not asynchronous and slices(events, WRITER, ""):
        fail("a synchronous save left slices on the writer thread")
    # With --async-save the writes run on while the loop trains: some write overlaps a step
    # after its save. Any later step and any save count, so a writer thread that a loaded
    # machine starts late still shows it. A synchronous write ends before the next step.
    overlapping = []
    for name, (begin, end) in writes.items():
        step = int(name.split("_")[1])
        later = [steps[str(s)] for s in range(step + 1, STEPS + 1)]
        if any(begin < s_end and s_begin < end for s_begin, s_end in later):
            overlapping.append(name)
    if asynchronous and not overlapping:
        fail(f"no async write overlaps a later step: writes {writes}, steps {steps}")
    if not asynchronous and overlapping:
        fail(f"the synchronous writes of {overlapping} overlap later steps")
    ranks = [e for e in events if e.get("pid") in (0, 1) and e["ph"] == "X"]
    if not ranks or min(e["ts"] for e in ranks) < steps[str(STEPS)][0] - 1:
        fail("the last step's per-rank timeline is missing or not placed at the last step")
    # Where the step ran its actions: after its batch was drawn and its pipeline started, so
    # the first action starts after the step's span does, and the last ends within it.
    first = min(e["ts"] for e in ranks)
    last = max(e["ts"] + e["dur"] for e in ranks)
    begin, end = steps[str(STEPS)]
    if not begin < first or last > end + 0.01:
        fail(f"the last step's actions, [{first}, {last}] us, are not where they ran, inside "
             f"its span [{begin}, {end}] us after the batch is drawn")


def main():
    conveyor, work = sys.argv[1], Path(sys.argv[2])
    check(traced_run(conveyor, work, "async", ["--async-save"]), asynchronous=True)
    check(traced_run(conveyor, work, "sync", []), asynchronous=False)
    print("run_trace_check: ok")


if __name__ == "__main__":
    main()
