"""The resume row's driver: one run of 2 epochs, and the same run resumed from its epoch-1 checkpoint in a second
folder, each on one torch-engine rank; exit 0 when the final checkpoints' model and optimizer state are bitwise
equal, 1 when not (the keys that differ printed), 2 when a run failed.

    python resume_check.py DIR CONFIG [--set KEY=VALUE ...]
"""
import os
import shutil
import subprocess
import sys


def train(config: str, sets: list, run_dir: str, resume: bool) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "hybridtrain",
           "train", "--config", config, "--engine", "torch", *sets, "--set", f"run_dir={run_dir}",
           "--set", "train.keep_checkpoints=2", *(["--resume"] if resume else [])]
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode != 0:
        sys.exit(2)


def differences(a, b, prefix: str = "") -> list:
    """The keys whose tensors or values differ (nested dicts and lists walked)."""
    import torch
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{prefix}: keys differ"]
        return [d for k in a for d in differences(a[k], b[k], f"{prefix}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{prefix}[{i}]")]
    if torch.is_tensor(a) and torch.is_tensor(b):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [prefix]
    return [] if a == b else [prefix]


def main(folder: str, config: str, sets: list) -> int:
    import torch
    straight, resumed = os.path.join(folder, "straight"), os.path.join(folder, "resumed")
    for path in (straight, resumed):
        shutil.rmtree(path, ignore_errors=True)
    train(config, sets, straight, resume=False)
    os.makedirs(resumed)
    for name in ("checkpoint-epoch0001.pt", "checkpoint-epoch0001.pt.sha256"):
        if os.path.exists(os.path.join(straight, name)):
            shutil.copy(os.path.join(straight, name), resumed)
    train(config, sets, resumed, resume=True)
    a, b = (torch.load(os.path.join(p, "checkpoint-epoch0002.pt"), map_location="cpu", weights_only=True)
            for p in (straight, resumed))
    diffs = differences({k: a[k] for k in ("model", "optimizer")}, {k: b.get(k) for k in ("model", "optimizer")})
    print("resume_check: final checkpoints " + ("bitwise equal" if not diffs else "differ: " + ", ".join(diffs[:10])))
    for path in (straight, resumed):  # hundreds of MiB of weights: metrics.jsonl and the config stay
        for name in os.listdir(path):
            if name.endswith((".pt", ".pt.sha256")):
                os.remove(os.path.join(path, name))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
