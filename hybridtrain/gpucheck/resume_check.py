"""gpu-check's resume row: one real run of the recipe, and the same run resumed from its epoch-1 checkpoint in a
second folder; the two final checkpoints must be bitwise equal (model, optimizer state, BN statistics).

    python -m hybridtrain.gpucheck.resume_check --out DIR --engine torch --config RECIPE [--set KEY=VALUE ...]

Both runs use the engine's launcher on one rank; ``train.deterministic=true`` belongs in the overrides on a GPU
(cuDNN's autotuned kernels are not bitwise repeatable). Writes DIR/resume_check.json; exit 0 when equal, 1 when
not, 2 for a run that failed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from hybridtrain.distributed.engines import ENGINES
from hybridtrain.distributed.launcher import launch_command
from hybridtrain.files import write_json_atomically

RESUME_AFTER = 1


def train(engine: str, config: str, sets: list[str], run_dir: str, resume: bool) -> None:
    sets = [*sets, f"run_dir={run_dir}", f"train.keep_checkpoints={RESUME_AFTER + 1}"]
    program = [sys.executable, "-m", "hybridtrain", "train", "--config", config, "--engine", engine,
               *[a for s in sets for a in ("--set", s)]]
    cmd = launch_command(engine, 1, program + (["--resume"] if resume else []))
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode != 0:
        print(f"resume_check: the {'resumed' if resume else 'straight'} run failed (its output above)", flush=True)
        sys.exit(2)


def last_checkpoint(run_dir: str) -> str:
    names = sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint-epoch") and n.endswith(".pt"))
    return os.path.join(run_dir, names[-1])


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The keys whose tensors or values differ between two checkpoints (nested dicts and lists walked)."""
    import torch
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{prefix}: keys {sorted(map(str, a.keys() ^ b.keys()))[:3]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{prefix}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{prefix}[{i}]")]
    if torch.is_tensor(a) and torch.is_tensor(b):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [prefix]
    return [] if a == b else [prefix]


def compare(straight: str, resumed: str) -> dict:
    import torch
    ours, theirs = (torch.load(p, map_location="cpu", weights_only=True) for p in (straight, resumed))
    compared = {k: ours[k] for k in ("model", "optimizer") if k in ours}
    diffs = differences(compared, {k: theirs.get(k) for k in compared})
    return {"straight": straight, "resumed": resumed, "equal": not diffs, "differences": diffs[:10]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="resume_check")
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=tuple(ENGINES), default="torch")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    straight, resumed = os.path.join(args.out, "straight"), os.path.join(args.out, "resumed")
    for folder in (straight, resumed):
        shutil.rmtree(folder, ignore_errors=True)
    train(args.engine, args.config, args.set, straight, resume=False)
    os.makedirs(resumed)
    name = f"checkpoint-epoch{RESUME_AFTER:04d}.pt"
    for suffix in ("", ".sha256"):
        if os.path.exists(os.path.join(straight, name + suffix)):
            shutil.copy(os.path.join(straight, name + suffix), os.path.join(resumed, name + suffix))
    train(args.engine, args.config, args.set, resumed, resume=True)
    result = compare(last_checkpoint(straight), last_checkpoint(resumed))
    write_json_atomically(os.path.join(args.out, "resume_check.json"), result)
    print(f"resume_check: final checkpoints {'bitwise equal' if result['equal'] else 'differ'}"
          + ("" if result["equal"] else f": {', '.join(result['differences'])}"), flush=True)
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
