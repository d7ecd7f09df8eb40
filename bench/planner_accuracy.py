#!/usr/bin/env python3
"""Planner accuracy on the CPU: plans a model whose loss head dominates for p ranks, runs the
chosen plan, and runs the same schedule and micro-batch count with the `uniform` and `params`
partitions; prints the predicted step time next to the measured median (steps 2..N) and each
rank's measured compute time in the last step (from --trace).
Usage: planner_accuracy.py CONVEYOR WORKDIR [model flags, default: d=128 L=8 V=16384, 4096
tokens per step]"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL = ["--d-model", "128", "--layers", "8", "--vocab", "16384", "--batch-tokens", "4096"]
MODEL = []


def run(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-1500:]}")
    return done.stdout


def measured(conveyor, work, name, flags, steps):
    log, trace = work / f"{name}.jsonl", work / f"{name}.trace.json"
    run([conveyor, "train", *MODEL, *flags, "--steps", str(steps), "--quiet",
         "--log-json", str(log), "--trace", str(trace)])
    seconds = [json.loads(line)["seconds"] for line in log.read_text().splitlines()][1:]
    events = json.loads(trace.read_text())["traceEvents"]
    busy = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid", 0) < 1000000 and e.get("tid") == 0:
            busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["dur"] / 1e6
    return statistics.median(seconds), [busy[r] for r in sorted(busy)]


def main():
    conveyor, work = sys.argv[1], Path(sys.argv[2])
    global MODEL
    MODEL = ["--device", "cpu"] + (sys.argv[3:] or DEFAULT_MODEL)
    work.mkdir(parents=True, exist_ok=True)
    plan_file = work / "plan.json"
    run([conveyor, "plan", *MODEL, "--stages", "2", "--repetitions", "5", "--out", str(plan_file)])
    plan = json.loads(plan_file.read_text())
    same = ["--stages", "2", "--schedule", plan["schedule"], "--microbatches",
            str(plan["microbatches"])]
    if plan["chunks"] > 1:
        same += ["--chunks", str(plan["chunks"])]
    rows = [("auto", ["--plan", str(plan_file)])]
    rows += [(p, same + ["--partition", p]) for p in ("uniform", "params")]
    print(f"plan: {plan['schedule']} m={plan['microbatches']} partition {plan['partition']}, "
          f"predicted step {plan['predicted_step_seconds']:.3f} s")
    print("| partition | measured step (median) | predicted | ratio | compute per rank, last step | predicted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, flags in rows:
        step, busy = measured(conveyor, work, name, flags, steps=6)
        predicted = plan["predicted_step_seconds"] if name == "auto" else None
        ratio = f"{step / predicted:.2f}" if predicted else ""
        pred = f"{predicted:.3f} s" if predicted else ""
        busy_pred = ""
        if name == "auto" and "predicted_rank_compute_seconds" in plan:
            busy_pred = ", ".join(f"{b:.3f} s" for b in plan["predicted_rank_compute_seconds"])
        print(f"| {name} | {step:.3f} s | {pred} | {ratio} | "
              + ", ".join(f"{b:.3f} s" for b in busy) + f" | {busy_pred} |")


if __name__ == "__main__":
    main()
