#!/usr/bin/env python3
"""A Conveyor checkpoint read with the Python `safetensors` package: every shard opens, and
holds the names, dtypes, shapes, checksums and values that `conveyor ckpt inspect` reports.

Usage: ckpt_interop.py CONVEYOR WORKDIR
Exits 77 (reported as skipped) when safetensors or numpy is missing; tools/bootstrap.sh
installs them.
"""
import json
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
    import safetensors
    from safetensors import safe_open
except ImportError as e:
    print(f"ckpt_interop: skipped, {e} (tools/bootstrap.sh installs safetensors and numpy)")
    sys.exit(77)


def fail(message):
    print(f"ckpt_interop: {message}", file=sys.stderr)
    sys.exit(1)


def run(*args):
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"{' '.join(args)} exited with {result.returncode}: {result.stderr}")
    return result.stdout


def main():
    conveyor, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ckpt = os.path.join(work, "ckpt")
    run(conveyor, "ckpt", "demo", ckpt, "--step", "5", "--ranks", "3", "--seed", "11")
    report = json.loads(run(conveyor, "ckpt", "inspect", ckpt, "--json", "--values", "1000000"))
    folder = report["directory"]

    by_shard = {}
    for t in report["tensors"]:
        by_shard.setdefault(t["shard"], {})[t["name"]] = t
    if sorted(by_shard) != sorted(s["file"] for s in report["shards"]):
        fail(f"inspect lists tensors in {sorted(by_shard)}, the manifest lists {report['shards']}")

    checked = 0
    for file, expected in by_shard.items():
        path = os.path.join(folder, file)
        with safe_open(path, framework="np") as f:
            if sorted(f.keys()) != sorted(expected):
                fail(f"{file}: safetensors finds {sorted(f.keys())}, inspect {sorted(expected)}")
            metadata = f.metadata()
            if metadata.get("format") != "conveyor" or metadata.get("format_version") != "1":
                fail(f"{file}: metadata {metadata}")
            if metadata.get("step") != str(report["step"]):
                fail(f"{file}: metadata step {metadata.get('step')}, manifest {report['step']}")
            for name, t in expected.items():
                if metadata.get("xxh3_64:" + name) != t["xxh3_64"]:
                    fail(f"{file}: checksum of {name} is {metadata.get('xxh3_64:' + name)} in "
                         f"the metadata, {t['xxh3_64']} in inspect")
                view = f.get_slice(name)
                if view.get_dtype() != t["dtype"] or list(view.get_shape()) != t["shape"]:
                    fail(f"{file}: {name} is {view.get_dtype()}{view.get_shape()}, inspect says "
                         f"{t['dtype']}{t['shape']}")
                if t["dtype"] != "BF16":  # numpy has no bfloat16
                    array = f.get_tensor(name)
                    want = np.array(t["values"], dtype=array.dtype).reshape(t["shape"])
                    if not np.array_equal(array, want):
                        fail(f"{file}: the values of {name} differ from inspect's")
                    checked += 1
        # Raw bytes for every dtype, bf16 included: widened to float32 exactly.
        with open(path, "rb") as raw:
            for name, info in safetensors.deserialize(raw.read()):
                t = expected[name]
                data = bytes(info["data"])
                if t["dtype"] == "BF16":
                    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
                    values = bits.view(np.float32)
                elif t["dtype"] == "F32":
                    values = np.frombuffer(data, dtype="<f4")
                else:
                    values = np.frombuffer(data, dtype="<i4")
                if values.tolist() != [type(v)(v) for v in t["values"]]:
                    fail(f"{file}: the bytes of {name} differ from inspect's values")
                if len(data) != t["bytes"]:
                    fail(f"{file}: {name} has {len(data)} bytes, inspect says {t['bytes']}")
                checked += 1
    total = len(report["tensors"])
    # Every tensor is read at least once, as raw bytes: fewer comparisons (none, where inspect
    # listed nothing) would let an empty report pass.
    if total == 0 or checked < total:
        fail(f"{checked} comparisons for {total} tensors listed by inspect")
    print(f"ckpt_interop: {len(by_shard)} shards, {total} tensors: names, dtypes, shapes, "
          f"checksums and values agree ({checked} comparisons)")
    check_pieces(conveyor, work)


def check_pieces(conveyor, work):
    """A sharded optimizer state: every shard opens, and each tensor put together from the
    pieces its "piece:" metadata places holds the values inspect reports."""
    ckpt = os.path.join(work, "sharded")
    run(conveyor, "train", "--device", "cpu", "--stages", "2", "--dp", "2", "--shard-optimizer",
        "--microbatches", "4", "--batch-tokens", "64", "--steps", "2", "--quiet",
        "--save-dir", ckpt)
    report = json.loads(run(conveyor, "ckpt", "inspect", ckpt, "--json", "--values", "1000000"))
    folder = report["directory"]
    assembled = {}
    for shard in report["shards"]:
        with safe_open(os.path.join(folder, shard["file"]), framework="np") as f:
            metadata = f.metadata()
            for name in f.keys():
                if "piece:" + name not in metadata:
                    continue
                piece = json.loads(metadata["piece:" + name])
                begin, end = piece["elements"]
                array = f.get_tensor(name)
                if list(array.shape) != [end - begin]:
                    fail(f"{shard['file']}: piece {name} has shape {array.shape}, "
                         f"expected [{end - begin}]")
                whole = assembled.setdefault(name, np.full(int(np.prod(piece["shape"])), np.nan,
                                                           dtype=np.float32))
                whole[begin:end] = array
    pieced = [t for t in report["tensors"] if "pieces" in t]
    if not pieced or sorted(assembled) != sorted(t["name"] for t in pieced):
        fail(f"pieces in the files {sorted(assembled)}, inspect {[t['name'] for t in pieced]}")
    for t in pieced:
        want = np.array(t["values"], dtype=np.float32)
        if not np.array_equal(assembled[t["name"]], want):
            fail(f"{t['name']} put together from its pieces differs from inspect's values")
    print(f"ckpt_interop: {len(report['shards'])} shards of a sharded state, {len(pieced)} "
          f"tensors in pieces, put together as inspect reports them")


if __name__ == "__main__":
    main()
