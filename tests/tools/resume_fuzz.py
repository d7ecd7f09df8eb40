#!/usr/bin/env python3
"""Exact resume of `conveyor train` as a randomised property.

Each draw, a function of --seed and the draw's index alone, picks a small model (sometimes
one so narrow that a sharded optimizer state has empty pieces), a global batch of M
micro-batches (the Markov source, or a --data file, sometimes shorter than the run so that
it wraps), an optimizer and learning-rate schedule and a run of S steps. It trains the S
steps straight through in one layout, then again as a chain of two or three legs: each stops
(--stop-after, or a signal with --signals) and saves (--save-dir, sometimes with
--save-every, --keep, --async-save), and the next resumes from a saved step (DIR, DIR/step_N,
DIR/latest, `latest` of its --save-dir, the same folder again, or an older step) in a layout
drawn afresh: stage count, schedule (gpipe, 1f1b, interleaved with --chunks, zbh1, zbv, or
the same from a `conveyor schedule --dump` file), partition (uniform, params, block counts),
--dp (1 or 2; up to 4 with --wide-dp), --shard-optimizer, --recompute (none, stage,
units:LIST), --threads, --bucket-mb, a copy of the data file at another path, and with
--mpirun, `mpirun -np stages x dp`. A leg now and then changes --microbatches, which a
resume may (the same global batch, summed in other parts).

Checked against the straight run, as docs/checkpoint-format.md and docs/distributed.md
promise on the CPU:
- while every leg sums the same micro-batches in the same replicas (the straight run's --dp
  and --microbatches; any stages, partition, schedule, sharding, recomputation, threads,
  process count), every logged step's loss, gradient norm and learning rate, the final
  weights checksum, the eval loss (at the end, and after a leg's --stop-after against the
  straight run stopped there) and every tensor of the last checkpoint stored whole in both,
  optimizer state included, are bitwise the straight run's; a step trained again (a leg
  resumed from an older save) is bitwise both times;
- a leg with another --dp on the same micro-batches starts from the same weights, so its
  first loss is still bitwise; from then on, and after another --microbatches, the losses,
  norms and eval loss agree to a relative 1e-4 (1e-2 for the degenerate widths), the
  learning rates bitwise;
- the last checkpoint's training state (step, optimizer, lr schedule, data position and token,
  rng) is always the straight run's;
- a resume of an older step into the folder whose `latest` is later is refused before it
  trains exactly when one of its saves would fall at or behind `latest`.

A run refused with exit status 2 for a layout the docs say the command line does not take
(EXPECTED_REFUSALS) makes the draw be drawn again, and is counted; any other refusal fails,
as does a mismatch or any other failure, reported with the commands that give it.

Usage: resume_fuzz.py CONVEYOR [--seed N] [--draws N] [--first I] [--work DIR]
                      [--wide-dp F] [--schedule-files F] [--mpirun PATH --mpi-share F]
                      [--signals F] [--keep-going]
(--signals makes where a leg stops depend on timing: for exploring, not for ctest.)
Exit status: 0 every draw agreed, 1 a mismatch, failure or unexpected refusal.
"""
import argparse
import collections
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zbh1", "zbv"]
# Loss, gradient norm and eval loss after a --dp change: another summation order, the
# difference of rounding grown by a few optimizer steps.
REL_TOL = 1e-4


# Refusals of layouts that docs/cli.md says the command line does not take.
EXPECTED_REFUSALS = [
    r"the pipeline has \d+ stages \(\d+ ranks x \d+ chunks of \w+\) but the model has \d+ units",
    r"cannot cut a model of \d+ blocks? into \d+ stages",
    r"interleaved 1F1B needs the micro-batch count to be a multiple of p=\d+",
]


def expected_refusal(message):
    return any(re.search(pattern, message) for pattern in EXPECTED_REFUSALS)


class Refused(Exception):
    """A run the command line refused with exit status 2."""


class Mismatch(Exception):
    """A promise broken, or a run that failed."""


def compositions(r, total, parts):
    """Random block counts: `parts` counts adding up to `total`, every middle one >= 1."""
    middle = max(parts - 2, 0)
    if total < middle:
        return None
    counts = [1 if 0 < i < parts - 1 else 0 for i in range(parts)]
    for _ in range(total - middle):
        counts[r.randrange(parts)] += 1
    return counts


class Draw:
    """One configuration: the fixed settings, the straight layout and the legs."""

    def __init__(self, r, data_dir, wide_dp):
        self.r = r
        self.steps = r.randint(3, 8)
        self.layers = r.randint(1, 6)
        self.units = self.layers + 2  # embedding, blocks, loss head
        self.micro = r.choice([1, 2, 2, 3, 4, 4, 6, 8])
        tokens = r.randint(max(8, 64 // self.micro), max(16, 400 // self.micro))
        self.batch_tokens = self.micro * tokens
        self.eval_batches = r.choice([0, 1, 2])
        fixed = ["--device", "cpu", "--quiet", "--weights-checksum", "--timeout", "60",
                 "--steps", str(self.steps), "--layers", str(self.layers),
                 "--batch-tokens", str(self.batch_tokens),
                 "--seed", str(r.randint(0, 2**40))]
        # Now and then tensors smaller than the replica count, whose pieces of a sharded state
        # are empty on some replicas.
        tiny = r.random() < 0.15
        # Degenerate widths (a layernorm over 1 or 2 features) amplify rounding.
        self.tolerance = 1e-2 if tiny else REL_TOL
        fixed += ["--d-model", str(r.randint(1, 5) if tiny else r.randint(16, 64))]
        self.data = r.random() < 0.2
        if self.data:
            # Enough bytes for the steps and the eval batches after them, plus the last target.
            size = self.batch_tokens * (self.steps + self.eval_batches) + 1 + r.randint(0, 50)
            if r.random() < 0.3:
                # A file shorter than the run: the steps wrap around it (and no batches are
                # left to evaluate).
                self.eval_batches = 0
                size = r.randint(self.batch_tokens + 1, self.batch_tokens * self.steps)
            path = os.path.join(data_dir, "data.bin")
            with open(path, "wb") as f:
                f.write(bytes(r.randrange(256) for _ in range(size)))
            fixed += ["--data", path]
        else:
            fixed += ["--vocab", str(r.randint(2, 8) if tiny else r.randint(16, 128))]
        if tiny or r.random() < 0.3:
            fixed += ["--hidden", str(r.randint(1, 5) if tiny else r.randint(8, 96))]
        if r.random() < 0.5:
            fixed += ["--activation", r.choice(["gelu", "relu"])]
        self.dp_choices = (1, 2, 3, 4) if r.random() < wide_dp else (1, 2)
        self.optimizer = r.choice(["adamw", "sgd"])
        lr = r.choice([0.001, 0.003, 0.01, 0.05])
        fixed += ["--optimizer", self.optimizer, "--lr", str(lr), "--warmup",
                  str(r.randint(0, self.steps + 1))]
        if r.random() < 0.5:
            fixed += ["--min-lr", str(lr * r.choice([0.0, 0.1, 0.5]))]
        if r.random() < 0.4:
            fixed += ["--weight-decay", str(r.choice([0.01, 0.1]))]
        if r.random() < 0.4:
            fixed += ["--clip", str(r.choice([0, 0.5, 2]))]
        self.fixed = fixed
        self.straight_dp = r.choice(self.dps(self.micro))
        self.straight = self.layout(self.straight_dp, self.micro)
        # Leg boundaries: steps after which a leg stops and saves.
        legs = r.choice([2, 2, 3]) if self.steps >= 3 else 2
        self.cuts = sorted(r.sample(range(1, self.steps), min(legs - 1, self.steps - 1)))
        self.leg_layouts = []
        for i in range(len(self.cuts) + 1):
            micro = self.micro
            # Now and then a resume with other micro-batches (which the docs let it change):
            # the same global batch, summed in other parts.
            others = [m for m in range(1, 17) if self.batch_tokens % m == 0 and m != micro]
            if i > 0 and others and r.random() < 0.12:
                micro = r.choice(others)
            dps = self.dps(micro)
            if r.random() < 0.35 or self.straight_dp not in dps:
                dp = r.choice(dps)
            else:
                dp = self.straight_dp
            self.leg_layouts.append(self.layout(dp, micro))

    def dps(self, micro):
        return [d for d in self.dp_choices if micro % d == 0]

    def layout(self, dp, micro):
        """A layout's flags, and what it is, for the coverage counts."""
        r = self.r
        schedule = r.choice(SCHEDULES)
        chunks = {"interleaved": r.choice([2, 2, 3]), "zbv": 2}.get(schedule, 1)
        per_replica = micro // dp
        # Mostly layouts the command line takes: stages with a unit each, and for interleaved
        # a micro-batch count per replica that the stage count divides; now and then any.
        stages = [p for p in range(1, 5) if p * chunks <= self.units and
                  (schedule != "interleaved" or per_replica % p == 0)]
        p = r.choice(stages) if stages and r.random() < 0.95 else r.randint(1, 4)
        flags = ["--schedule", schedule, "--stages", str(p), "--microbatches", str(micro)]
        if schedule == "interleaved" and (chunks != 2 or r.random() < 0.5):
            flags += ["--chunks", str(chunks)]
        partition = r.choice(["uniform", "uniform", "params", "counts"])
        if partition == "counts":
            counts = compositions(r, self.layers, p * chunks)
            if counts is None:
                partition = "uniform"
            else:
                flags += ["--partition", ",".join(map(str, counts))]
        elif partition == "params":
            flags += ["--partition", "params"]
        shard = dp > 1 and r.random() < 0.5
        if dp > 1:
            flags += ["--dp", str(dp)]
            if shard:
                flags += ["--shard-optimizer"]
            if r.random() < 0.3:
                flags += ["--bucket-mb", r.choice(["0", "0.001", "0.002"])]
        recompute = r.choice(["none", "none", "stage", "units"])
        if recompute == "units":
            chosen = sorted(r.sample(range(self.units), r.randint(1, self.units)))
            flags += ["--recompute", "units:" + ",".join(map(str, chosen))]
        elif recompute == "stage":
            flags += ["--recompute", "stage"]
        threads = r.choice([0, 0, 1, 2])
        if threads:
            flags += ["--threads", str(threads)]
        return {"flags": flags, "dp": dp, "micro": micro, "stages": p, "schedule": schedule,
                "shard": shard, "recompute": recompute, "partition": partition, "mpi": False}


def logged_rows(log):
    try:
        with open(log) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except FileNotFoundError:
        return 0


def run(cli, launcher, flags, log, cwd, interrupt=None):
    """One `conveyor train`: (rows of --log-json by step, the eval record, output, command).
    interrupt (ROWS, SIGNAL): send SIGNAL once the log holds ROWS steps; the run then ends
    with status 128 + SIGNAL, or 0 when it finished first."""
    command = launcher + [cli, "train"] + flags + ["--log-json", log]
    ok = {0}
    try:
        if interrupt is None:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
            status, out = done.returncode, done.stdout + done.stderr
        else:
            rows, sig = interrupt
            ok.add(128 + sig)
            with open(log + ".out", "w+") as output:
                process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                           cwd=cwd)
                deadline = time.monotonic() + 300
                while process.poll() is None and logged_rows(log) < rows:
                    if time.monotonic() > deadline:
                        process.kill()
                        break
                    time.sleep(0.0005)
                if process.poll() is None:
                    process.send_signal(sig)
                status = process.wait(timeout=300)
                output.seek(0)
                out = output.read()
    except subprocess.TimeoutExpired:
        raise Mismatch(f"timed out after 300 s: {shlex.join(command)}")
    if status == 2:
        refusal = Refused(next((line for line in out.splitlines() if "error" in line),
                               out.strip()))
        refusal.command = shlex.join(command)
        raise refusal
    if status not in ok:
        raise Mismatch(f"exit status {status}: {shlex.join(command)}\n{out[-2000:]}")
    rows, evaluation = [], None
    with open(log) as f:
        for line in f:
            row = json.loads(line)
            if "step" in row:
                rows.append(row)
            else:
                evaluation = row
    return rows, evaluation, out, command


def checksum(out):
    lines = [line for line in out.splitlines() if line.startswith("weights xxh3 ")]
    return lines[-1] if lines else None


def close(a, b, tolerance):
    return a == b or abs(a - b) <= tolerance * max(abs(a), abs(b))


def saved_steps(folder):
    if not os.path.isdir(folder):
        return []
    return sorted(int(n[5:]) for n in os.listdir(folder)
                  if n.startswith("step_") and n[5:].isdigit())


def check_draw(cli, d, r, work, mpirun, mpi_share, signals, schedule_files):
    """Runs one draw; raises Refused or Mismatch, returns what it covered."""
    commands = []

    def leg_run(name, launcher, flags, interrupt=None):
        log = os.path.join(work, name + ".jsonl")
        rows, evaluation, out, command = run(cli, launcher, flags, log, work, interrupt)
        commands.append(shlex.join(command))
        return rows, evaluation, out

    def launcher_for(layout):
        if mpirun and r.random() < mpi_share and layout["stages"] * layout["dp"] <= 4:
            layout["mpi"] = True
            return [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                    "-np", str(layout["stages"] * layout["dp"])]
        return []

    straight_eval = ["--eval-batches", str(d.eval_batches)] if d.eval_batches else []
    ref_dir = os.path.join(work, "straight_ckpt")
    ref_rows, ref_eval, ref_out = leg_run("straight", [], d.fixed + d.straight["flags"] +
                                          straight_eval + ["--save-dir", ref_dir])
    ref = {row["step"]: row for row in ref_rows}
    if sorted(ref) != list(range(1, d.steps + 1)):
        raise Mismatch(f"the straight run logged steps {sorted(ref)}")

    def fail(message):
        raise Mismatch(message + "\n" + "\n".join(commands))

    def same_sums(layout):
        return layout["dp"] == d.straight_dp and layout["micro"] == d.micro

    exact = True  # the chain's weights and state are still bitwise the straight run's
    behind = None  # the step `latest` names when a leg resumes an older step into its folder
    start = 0  # the step the next leg resumes from (0: fresh)
    resume = []
    kinds = []
    for i, layout in enumerate(d.leg_layouts):
        stop = d.steps if i == len(d.leg_layouts) - 1 else max(d.cuts[i], start + 1)
        last = stop >= d.steps
        fixed = list(d.fixed)
        kind = []
        if d.data and i > 0 and r.random() < 0.3:
            # The same bytes at another path resume as the original file does.
            at = fixed.index("--data") + 1
            copy = os.path.join(work, f"copy{i}.bin")
            shutil.copyfile(fixed[at], copy)
            fixed[at] = copy
            kind.append("data copy")
        flags = fixed + layout["flags"] + resume
        if r.random() < schedule_files:
            # The same layout from a file of `conveyor schedule --dump`, text or CSV.
            dump = os.path.join(work, f"schedule{i}" + r.choice([".txt", ".csv"]))
            generate = [cli, "schedule", "--kind", layout["schedule"],
                        "--stages", str(layout["stages"]),
                        "--microbatches", str(layout["micro"] // layout["dp"]),
                        "--dp", str(layout["dp"]), "--dump", dump]
            if "--chunks" in layout["flags"]:
                generate += ["--chunks", layout["flags"][layout["flags"].index("--chunks") + 1]]
            done = subprocess.run(generate, capture_output=True, text=True, timeout=120)
            if done.returncode == 2:
                refusal = Refused(done.stderr.strip())
                refusal.command = shlex.join(generate)
                raise refusal
            if done.returncode != 0:
                fail(f"{shlex.join(generate)} exited with {done.returncode}: {done.stderr}")
            commands.append(shlex.join(generate))
            flags += ["--schedule-file", dump]
            if "--bucket-mb" in flags:  # the file keeps its own buckets
                at = flags.index("--bucket-mb")
                del flags[at:at + 2]
            kind.append("schedule file")
        folder = os.path.join(work, f"ckpt{i}")
        if "--save-dir" in resume:
            folder = resume[resume.index("--save-dir") + 1]
        else:
            flags += ["--save-dir", folder]
        interrupt = None
        if not last and r.random() < signals and behind is None:
            # Stopped by a signal once the leg has logged its steps (or a little later): the
            # run saves the last step it finished on its way out.
            interrupt = (stop - start, r.choice([signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                                 signal.SIGUSR1]))
            kind.append(f"signal {signal.Signals(interrupt[1]).name}")
        eval_here = d.eval_batches if last else (d.eval_batches if r.random() < 0.2 else 0)
        save_every = 0
        if not last and not interrupt:
            flags += ["--stop-after", str(stop)]
            if r.random() < 0.6:
                save_every = r.randint(1, max(1, stop - start))
                flags += ["--save-every", str(save_every)]
            if r.random() < 0.2:
                flags += ["--keep", str(r.randint(1, 2))]
        if r.random() < 0.3:
            flags += ["--async-save"]
        if eval_here:
            flags += ["--eval-batches", str(eval_here)]
        launcher = launcher_for(layout) if i > 0 or r.random() < 0.5 else []
        if interrupt and launcher:
            # OpenMPI's mpirun passes SIGUSR1 on to every process.
            interrupt = (interrupt[0], signal.SIGUSR1)
            kind[-1] = "signal SIGUSR1 to mpirun"
        try:
            rows, evaluation, out = leg_run(f"leg{i}", launcher, flags, interrupt)
            if behind is not None and first_save(save_every, start, stop) <= behind:
                fail(f"leg {i} resumed step {start} into the folder whose 'latest' names step "
                     f"{behind}, and its first save, step {first_save(save_every, start, stop)}, "
                     "was not refused")
        except Refused as e:
            if behind is None or first_save(save_every, start, stop) > behind or \
                    expected_refusal(str(e)):
                raise
            if "would refuse a save of this run" not in str(e):
                fail(f"leg {i} was refused for another reason than its save behind 'latest': {e}")
            # Refused as the docs say; the leg saves into a folder of its own instead.
            kind.append("refused save behind latest")
            at = flags.index("--save-dir") + 1
            folder = flags[at] = os.path.join(work, f"ckpt{i}b")
            rows, evaluation, out = leg_run(f"leg{i}", launcher, flags, interrupt)
        behind = None
        if interrupt and rows:
            stop = rows[-1]["step"]
            last = stop >= d.steps
            if not last and evaluation is not None:
                fail(f"leg {i} was interrupted after step {stop} and still evaluated")
            # A run interrupted while it evaluates prints no eval line either.
            eval_here = 0
        got_steps = [row["step"] for row in rows]
        if got_steps != list(range(start + 1, stop + 1)):
            fail(f"leg {i} logged steps {got_steps}, expected {start + 1}..{stop}")
        bitwise = exact and same_sums(layout)
        for row in rows:
            want = ref[row["step"]]
            # Another --dp on the same micro-batches starts from the same weights: its first
            # loss is the sum of the same per-micro-batch losses.
            bitwise_loss = bitwise or (exact and row["step"] == start + 1 and
                                       layout["micro"] == d.micro)
            problems = []
            if row["lr"] != want["lr"]:
                problems.append(f"lr {row['lr']!r} != {want['lr']!r}")
            for key, exactly in (("loss", bitwise_loss), ("grad_norm", bitwise)):
                if exactly and row[key] != want[key]:
                    problems.append(f"{key} {row[key]!r} != {want[key]!r} (bitwise)")
                elif not exactly and not close(row[key], want[key], d.tolerance):
                    problems.append(f"{key} {row[key]!r} vs {want[key]!r} beyond {d.tolerance}")
            if problems:
                fail(f"leg {i}, step {row['step']}: " + "; ".join(problems))
        exact = bitwise
        kind.append("same sums" if same_sums(layout) else
                    "dp change" if layout["micro"] == d.micro else "microbatches change")
        if layout["mpi"]:
            kind.append("mpirun")
        if eval_here:
            if evaluation is None:
                fail(f"leg {i} logged no eval record")
            want = ref_eval
            if not last:
                # What the straight run evaluates when stopped at the same step.
                kind.append("eval at stop")
                _, want, _ = leg_run(f"straight_stop{i}", [], d.fixed + d.straight["flags"] +
                                     ["--stop-after", str(stop), "--eval-batches", str(eval_here)])
            a, b = evaluation["eval_loss"], want["eval_loss"]
            if (exact and a != b) or (not exact and not close(a, b, d.tolerance)):
                fail(f"leg {i}: eval loss {a!r} != {b!r}" + (" (bitwise)" if exact else ""))
        steps = saved_steps(folder)
        if not steps or steps[-1] != stop:
            fail(f"leg {i} stopped at step {stop} and left saves {steps} in {folder}")
        if last:
            if exact and checksum(out) != checksum(ref_out):
                fail(f"final weights: '{checksum(out)}' != '{checksum(ref_out)}'")
            compare_checkpoints(cli, ref_dir, folder, exact, fail)
            kinds.append(", ".join(kind))
            break
        # The next leg resumes from one of the saved steps.
        how = r.choice(["dir", "step", "latest_file", "latest", "older", "dir_same", "step_same",
                        "older_same"])
        if how.startswith("older") and len(steps) == 1:
            how = "dir"
        if how.startswith("older"):
            start = r.choice(steps[:-1])
            resume = ["--resume", os.path.join(folder, f"step_{start}")]
            if how == "older_same":
                # Into the folder whose `latest` is later: refused before training when a
                # save of the run would fall at or behind that step.
                resume += ["--save-dir", folder]
                behind = stop
        else:
            start = stop
            resume = {"dir": ["--resume", folder],
                      "step": ["--resume", os.path.join(folder, f"step_{stop}")],
                      "latest_file": ["--resume", os.path.join(folder, "latest")],
                      "latest": ["--resume", "latest", "--save-dir", folder],
                      "dir_same": ["--resume", folder, "--save-dir", folder],
                      "step_same": ["--resume", os.path.join(folder, f"step_{stop}"),
                                    "--save-dir", folder]}[how]
        kind.append(f"resume {how}")
        kinds.append(", ".join(kind))
    return kinds


def first_save(save_every, start, stop):
    """The first step a leg from `start` to `stop` saves."""
    every = [s for s in range(start + 1, stop + 1) if save_every and s % save_every == 0]
    return min(every + [stop])


def inspect(cli, folder):
    done = subprocess.run([cli, "ckpt", "inspect", "--json", folder], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise Mismatch(f"ckpt inspect --json {folder}: exit {done.returncode}: {done.stderr}")
    return json.loads(done.stdout)


def compare_checkpoints(cli, ref_dir, got_dir, exact, fail):
    """The chain's last checkpoint against the straight run's: the same training state, and
    when the chain is bitwise the straight run, the same bytes of every tensor stored whole in
    both (the optimizer state included, which the weights checksum does not cover)."""
    ref, got = inspect(cli, ref_dir), inspect(cli, got_dir)
    # A leg may have read a copy of the data file: the source then names another path.
    same_source = ref["data"]["source"] == got["data"]["source"]
    for state in (ref, got):
        state["data"].pop("source")
    differ = {k: (ref[k], got[k]) for k in ("step", "optimizer", "lr_schedule", "data", "rng")
              if ref[k] != got[k]}
    if differ or (same_source and ref["state_xxh3_64"] != got["state_xxh3_64"]):
        fail(f"training state of {got_dir} differs from {ref_dir}: {json.dumps(differ)}")
    if not exact:
        return
    ref_tensors = {t["name"]: t for t in ref["tensors"]}
    got_tensors = {t["name"]: t for t in got["tensors"]}
    if sorted(ref_tensors) != sorted(got_tensors):
        fail(f"{got_dir} holds other tensors than {ref_dir}")
    for name, t in ref_tensors.items():
        u = got_tensors[name]
        if "xxh3_64" in t and "xxh3_64" in u and t["xxh3_64"] != u["xxh3_64"]:
            fail(f"tensor {name}: xxh3 {u['xxh3_64']} in {got_dir}, {t['xxh3_64']} in {ref_dir}")
        if "pieces" in t and "pieces" in u:
            a = {tuple(p["elements"]): p["xxh3_64"] for p in t["pieces"]}
            b = {tuple(p["elements"]): p["xxh3_64"] for p in u["pieces"]}
            if a != b:
                fail(f"tensor {name}: pieces {b} in {got_dir}, {a} in {ref_dir}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("conveyor")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--work", default=None,
                        help="folder for the runs (default: a temporary one)")
    parser.add_argument("--mpirun", default="",
                        help="mpirun to launch some legs with (default: none)")
    parser.add_argument("--mpi-share", type=float, default=0.15,
                        help="share of the resumed legs launched under mpirun")
    parser.add_argument("--wide-dp", type=float, default=0.0,
                        help="share of the draws with --dp up to 4 (else 1 or 2)")
    parser.add_argument("--signals", type=float, default=0.0,
                        help="share of the legs stopped by a signal rather than --stop-after "
                             "(where they stop depends on timing: for exploring, not for ctest)")
    parser.add_argument("--schedule-files", type=float, default=0.15,
                        help="share of the legs run from a `conveyor schedule --dump` file")
    parser.add_argument("--keep-going", action="store_true", help="go on after a mismatch")
    parser.add_argument("--first", type=int, default=0, help="index of the first draw")
    args = parser.parse_args()
    cli = os.path.abspath(args.conveyor)
    base = args.work or tempfile.mkdtemp(prefix="resume_fuzz.")
    os.makedirs(base, exist_ok=True)

    refusals = collections.Counter()
    coverage = collections.Counter()
    failures = 0
    ran = refused = 0
    for index in range(args.first, args.first + args.draws):
        attempt = 0
        while True:
            # Each draw and each redraw is a function of the seed and its indices alone.
            r = random.Random(f"{args.seed}/{index}/{attempt}")
            work = os.path.join(base, f"draw{index}")
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            d = Draw(r, work, args.wide_dp)
            try:
                kinds = check_draw(cli, d, r, work, args.mpirun, args.mpi_share, args.signals,
                                    args.schedule_files)
            except Refused as e:
                if not expected_refusal(str(e)):
                    failures += 1
                    print(f"draw {index} (attempt {attempt}): REFUSED for a reason the docs do "
                          f"not give for these flags: {e}\n{getattr(e, 'command', '')}\n",
                          flush=True)
                    if not args.keep_going:
                        print(f"the runs are in {work}")
                        sys.exit(1)
                    break
                refused += 1
                refusals[str(e)] += 1
                attempt += 1
                if attempt < 20:
                    continue
                print(f"draw {index}: 20 draws refused in a row, last: {e}")
                break
            except Mismatch as e:
                failures += 1
                print(f"draw {index} (attempt {attempt}): MISMATCH {e}\n", flush=True)
                if not args.keep_going:
                    print(f"the runs are in {work}")
                    sys.exit(1)
                break
            ran += 1
            for layout in [d.straight] + d.leg_layouts:
                coverage[f"schedule {layout['schedule']}"] += 1
                coverage[f"stages {layout['stages']}"] += 1
                coverage[f"dp {layout['dp']}" + (" sharded" if layout["shard"] else "")] += 1
                coverage[f"recompute {layout['recompute']}"] += 1
                coverage[f"partition {layout['partition']}"] += 1
            coverage[f"optimizer {d.optimizer}"] += 1
            coverage["data file" if d.data else "markov"] += 1
            coverage[f"{len(kinds)} legs"] += 1
            for kind in kinds:
                for part in kind.split(", "):
                    coverage[part] += 1
            shutil.rmtree(work, ignore_errors=True)
            break
    print(f"{ran} draws ran, {refused} refused (exit 2) and drawn again, {failures} mismatched")
    print("covered: " + ", ".join(f"{k} {v}" for k, v in sorted(coverage.items())))
    for message, count in refusals.most_common():
        print(f"refused {count}x: {message}")
    if not args.work:
        shutil.rmtree(base, ignore_errors=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
