#!/usr/bin/env python3
"""Conveyor against PyTorch on the CPU, side by side in one run on one machine.

For each model it trains the same configuration with `conveyor train --device cpu` and with
bench/torch_reference.py (torch.nn modules, same shapes, AdamW, clipping, micro-batches), takes
the median step time of each after warm-up, and prints tokens/s and the ratio Conveyor/PyTorch.

  bench/compare_torch.py --conveyor build/tools/conveyor            # both models, 1 thread
  bench/compare_torch.py --conveyor build/tools/conveyor --threads 1 2 --stages 1 2

PyTorch comes from Debian's python3-torch (with libopenblas0-pthread); its BLAS pool is pinned
with OPENBLAS_NUM_THREADS, which torch.set_num_threads does not reach. The interpreter runs
with -s so that packages in the user's site directory (a newer NumPy, say) cannot shadow
Debian's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODELS = {
    # name: flags shared by both engines
    "tiny": dict(d_model=64, layers=2, vocab=64, hidden=256, batch_tokens=4096, microbatches=4),
    "gemm": dict(d_model=256, layers=4, vocab=4096, hidden=1024, batch_tokens=4096,
                 microbatches=4),
}


def run(cmd, what, **kwargs):
    """Runs cmd; a failure is said in one line, with the last line the command wrote, and ends
    the comparison (a traceback through subprocess would hide why: its stderr is captured)."""
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs).stdout
    except FileNotFoundError:
        sys.exit(f"compare_torch: {what}: {cmd[0]} not found")
    except OSError as e:  # a folder, a file that is not executable
        sys.exit(f"compare_torch: {what}: cannot run {cmd[0]}: {e.strerror}")
    except subprocess.CalledProcessError as e:
        said = (e.stderr or e.stdout or "").strip().splitlines()
        reason = said[-1] if said else "no output"
        if "No module named 'torch'" in reason:
            reason += " (install python3-torch, or give --python an interpreter that has it)"
        sys.exit(f"compare_torch: {what} failed with exit status {e.returncode}: {reason}")


def flags(model):
    out = []
    for key, value in model.items():
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


def train_help(binary):
    """`conveyor train --help`, asked before any run: a wrong --conveyor is said at once, not
    after the PyTorch runs, and a program that is not conveyor is named as such."""
    text = run([binary, "train", "--help"], f"{binary} train --help")
    if "--log-json" not in text:
        sys.exit(f"compare_torch: {binary} is not the conveyor command line: its `train --help` "
                 "does not list --log-json")
    return text


def conveyor_tokens_per_s(binary, help_text, model, threads, stages, warmup, steps):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "steps.jsonl")
        cmd = [binary, "train", "--device", "cpu", "--quiet", "--steps", str(warmup + steps),
               "--stages", str(stages), "--log-json", log] + flags(model)
        if "--threads" in help_text:
            cmd += ["--threads", str(threads)]
        elif threads != 1:
            return None  # this build has no thread control: no figure rather than a wrong one
        run(cmd, f"{binary} train")
        with open(log) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    timed = [r["seconds"] for r in rows[warmup:]]
    return model["batch_tokens"] / statistics.median(timed)


def torch_tokens_per_s(model, threads, warmup, steps):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_reference.py")
    cmd = [args.python, "-s", script, "--threads", str(threads), "--warmup", str(warmup),
           "--steps", str(steps)] + flags(model)
    out = run(cmd, f"the PyTorch reference ({args.python} -s {script})", env=env)
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def at_least(low):
    """An argparse type: a whole number of at least `low`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {low}, "
                                             f"got '{text}'")
        return value
    return parse


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conveyor", default="build/tools/conveyor")
    ap.add_argument("--python", default="/usr/bin/python3", help="the interpreter with torch")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", nargs="+", type=at_least(1), default=[1])
    ap.add_argument("--stages", nargs="+", type=at_least(1), default=[1])
    ap.add_argument("--warmup", type=at_least(0), default=3)
    ap.add_argument("--steps", type=at_least(1), default=20)
    args = ap.parse_args()
    conveyor_help = train_help(args.conveyor)

    print(f"{'model':6} {'stages':>6} {'threads':>7} {'conveyor tok/s':>15} "
          f"{'pytorch tok/s':>14} {'ratio':>6}")
    for name in args.models:
        model = MODELS[name]
        torch_by_threads = {t: torch_tokens_per_s(model, t, args.warmup, args.steps)
                            for t in args.threads}
        best_torch = max(torch_by_threads.values())
        for stages in args.stages:
            for threads in args.threads:
                ours = conveyor_tokens_per_s(args.conveyor, conveyor_help, model, threads,
                                             stages, args.warmup, args.steps)
                # The ratio is against PyTorch at the same thread count, and (last column of
                # the doc) against its fastest thread count.
                theirs = torch_by_threads[threads]
                ratio = f"{ours / theirs:6.2f}" if ours else "   n/a"
                ours_text = f"{ours:15.0f}" if ours else f"{'n/a':>15}"
                print(f"{name:6} {stages:6d} {threads:7d} {ours_text} {theirs:14.0f} {ratio}"
                      f"   (best PyTorch {best_torch:.0f} tok/s)")
        sys.stdout.flush()
