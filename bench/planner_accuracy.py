#!/usr/bin/env python3
"""Planner accuracy: plans a model for p ranks, runs the chosen plan, and runs the same
schedule and micro-batch count with the `uniform` and `params` partitions; prints the
predicted step time next to the measured median (steps 2..N) and each rank's measured compute
time in the last step (from --trace).

Usage: planner_accuracy.py CONVEYOR WORKDIR [--device cpu|cuda] [--stages P] [--steps N]
                           [--repetitions R] [model flags of `conveyor plan` and `train`]
Without model flags: a model whose loss head dominates (d=128 L=8 V=16384, 4096 tokens per
step) on the CPU at p=2. On the H200: --device cuda --stages 4 --preset medium
--batch-tokens 16384 (all ranks share the one GPU)."""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL = ["--d-model", "128", "--layers", "8", "--vocab", "16384", "--batch-tokens", "4096"]


def run(cmd):
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # not found, not executable: one line, not a traceback
        sys.exit(f"planner_accuracy: cannot run {cmd[0]}: {e.strerror}")
    if done.returncode != 0:
        # The model flags go to conveyor as given: its refusal of one (status 2) is this
        # script's, so its status is passed on, not turned into 1.
        said = done.stderr.strip()[-1500:] or "no output"
        print(f"planner_accuracy: {' '.join(cmd)} failed with exit status {done.returncode}: "
              f"{said}", file=sys.stderr)
        sys.exit(done.returncode if done.returncode > 0 else 1)
    return done.stdout


def measured(conveyor, model, work, name, flags, steps):
    log, trace = work / f"{name}.jsonl", work / f"{name}.trace.json"
    run([conveyor, "train", *model, *flags, "--steps", str(steps), "--quiet",
         "--log-json", str(log), "--trace", str(trace)])
    seconds = [json.loads(line)["seconds"] for line in log.read_text().splitlines()][1:]
    events = json.loads(trace.read_text())["traceEvents"]
    busy = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid", 0) < 1000000 and e.get("tid") == 0:
            busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["dur"] / 1e6
    return statistics.median(seconds), [busy[r] for r in sorted(busy)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("conveyor")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps of each run (the first is left out)")
    parser.add_argument("--repetitions", type=int, default=5, help="of each unit in the profile")
    args, model_flags = parser.parse_known_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out of the median")
    model = ["--device", args.device] + (model_flags or DEFAULT_MODEL)
    work = args.workdir
    if work.exists() and not work.is_dir():
        parser.error(f"WORKDIR '{work}' exists and is not a folder")
    work.mkdir(parents=True, exist_ok=True)
    plan_file = work / "plan.json"
    # A plan.json an earlier run left must not pass for this run's.
    plan_file.unlink(missing_ok=True)
    run([args.conveyor, "plan", *model, "--stages", str(args.stages), "--repetitions",
         str(args.repetitions), "--out", str(plan_file)])
    if not plan_file.is_file():
        sys.exit(f"planner_accuracy: {args.conveyor} plan wrote no {plan_file}: is it the "
                 "conveyor command line?")
    plan = json.loads(plan_file.read_text())
    same = ["--stages", str(args.stages), "--schedule", plan["schedule"], "--microbatches",
            str(plan["microbatches"])]
    if plan["chunks"] > 1:
        same += ["--chunks", str(plan["chunks"])]
    rows = [("auto", ["--plan", str(plan_file)])]
    rows += [(p, same + ["--partition", p]) for p in ("uniform", "params")]
    print(f"{' '.join(model)} --stages {args.stages}")
    print(f"plan: {plan['schedule']} m={plan['microbatches']} partition {plan['partition']}, "
          f"predicted step {plan['predicted_step_seconds']:.3f} s")
    print("| partition | measured step (median) | predicted | ratio | compute per rank, last step | predicted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, flags in rows:
        step, busy = measured(args.conveyor, model, work, name, flags, args.steps)
        predicted = plan["predicted_step_seconds"] if name == "auto" else None
        ratio = f"{step / predicted:.2f}" if predicted else ""
        pred = f"{predicted:.3f} s" if predicted else ""
        busy_pred = ""
        if name == "auto" and "predicted_rank_compute_seconds" in plan:
            busy_pred = ", ".join(f"{b:.3f} s" for b in plan["predicted_rank_compute_seconds"])
        print(f"| {name} | {step:.3f} s | {pred} | {ratio} | "
              + ", ".join(f"{b:.3f} s" for b in busy) + f" | {busy_pred} |", flush=True)


if __name__ == "__main__":
    main()
