#!/usr/bin/env python3
"""Commands whose stdout is a pipe with no reader left end as on the other stop signals.

`train`: its reader closes the pipe once step 2's progress line came; the run stops after the
step in progress, saves it, says so on stderr and exits 141 (128 + SIGPIPE), not killed by
SIGPIPE with nothing saved. `schedule --trace --svg`: into a pipe already closed, it ends by
SIGPIPE with no temporary of its files left behind. A run whose reader goes away after its
last step ends with 141 too.

Usage: closed_pipe.py CONVEYOR WORKDIR
"""
import os
import re
import shutil
import signal
import subprocess
import sys

cli, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)


def fail(why):
    print(f"closed_pipe: {why}", file=sys.stderr)
    sys.exit(1)


def train_until(flags, step, sigpipe_ignored=False):
    """Runs `conveyor train FLAGS`, closes its stdout once the line of step STEP came, and
    returns its status and stderr. `sigpipe_ignored`: the run starts with SIGPIPE ignored, as
    Python itself runs."""
    run = subprocess.Popen(
        [cli, "train", "--device", "cpu", "--batch-tokens", "64", "--log-every", "1"] + flags,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        restore_signals=not sigpipe_ignored)
    for line in run.stdout:
        print(line, end="")
        if re.match(rf"^step +{step}/", line):
            break
    else:
        fail(f"train {' '.join(flags)}: the run ended before step {step}")
    run.stdout.close()
    try:
        err = run.stderr.read()
        status = run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        run.kill()
        fail(f"train {' '.join(flags)}: the run went on for 120 s after its stdout was closed")
    print(err, end="")
    return status, err


# train: the pipe is closed once the run is training.
save_dir = os.path.join(work, "ck")
status, err = train_until(["--steps", "100000", "--microbatches", "1", "--save-dir", save_dir,
                           "--save-every", "100000"], 2)
if status != 128 + signal.SIGPIPE:
    fail(f"train: status {status}, expected {128 + signal.SIGPIPE} (-13: killed by SIGPIPE)")
said = re.search(r"^conveyor: stdout was closed \(SIGPIPE\); the run stopped after step "
                 r"(\d+), saved into '.*ck'$", err, re.M)
if not said:
    fail("train: no line on stderr saying where the run stopped")
latest = open(os.path.join(save_dir, "latest")).read().strip()
if latest != f"step_{said.group(1)}":
    fail(f"train: latest names {latest}, the run stopped after step {said.group(1)}")
if subprocess.run([cli, "ckpt", "verify", save_dir], stdout=subprocess.DEVNULL).returncode:
    fail("train: the saved step does not verify")

# train, started with SIGPIPE ignored: its writes to the closed pipe fail without the signal,
# and the run stops as on any stdout that refuses its lines, saving the step (status 1).
save_dir = os.path.join(work, "ck_ignored")
status, err = train_until(["--steps", "100000", "--microbatches", "1", "--save-dir", save_dir,
                           "--save-every", "100000"], 2, sigpipe_ignored=True)
said = re.search(r"^conveyor: error: cannot write stdout: Broken pipe; the run stopped after "
                 r"step (\d+)$", err, re.M)
if status != 1 or not said:
    fail(f"train, SIGPIPE ignored: status {status}, expected 1 and the broken pipe said")
latest = open(os.path.join(save_dir, "latest")).read().strip()
if latest != f"step_{said.group(1)}":
    fail(f"train, SIGPIPE ignored: latest names {latest}, the run stopped after step "
         f"{said.group(1)}")

# train: the reader goes away after the last step's line, while the run prints its summary:
# the run is done and cannot stop, and ends as a SIGPIPE during it does (141), not as a full
# disk's "cannot write stdout" (1). 0 where the summary was in the pipe before the reader left.
status, err = train_until(["--steps", "3", "--stages", "2", "--microbatches", "2",
                           "--weights-checksum"], 3)
if status not in (0, 128 + signal.SIGPIPE) or err:
    fail(f"train, the reader gone after the last step: status {status}, expected "
         f"{128 + signal.SIGPIPE} (or 0, the summary in the pipe before it left)")
print(f"train, the reader gone after the last step: status {status}")

# schedule: stdout's reader is gone before the command starts.
out = os.path.join(work, "schedule")
os.makedirs(out)
read_end, write_end = os.pipe()
os.close(read_end)
status = subprocess.run(
    [cli, "schedule", "-p", "16", "-m", "32", "--trace", os.path.join(out, "t.json"),
     "--svg", os.path.join(out, "s.svg")], stdout=write_end).returncode
os.close(write_end)
if status != -signal.SIGPIPE:
    fail(f"schedule: status {status}, expected to end by SIGPIPE")
left = [name for name in os.listdir(out) if ".tmp." in name]
if left:
    fail(f"schedule: temporaries left behind: {left}")
