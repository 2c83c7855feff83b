"""Every file the project writes is written atomically: a writer killed (SIGKILL, no cleanup) at any moment of a
write leaves the old file or the new one, never a broken one. The writers every run, tool and record goes through
(files.write_text_atomically / write_json_atomically: config.yaml, run records, tables; checkpoint.atomic_save:
checkpoints and final_model.pt; files.replace_file: a crash log, torchrun's error file, the refusal mark;
files.append_json_line: metrics.jsonl's and the sample audit's lines, each whole or absent) are killed
mid-write again and again by a real process."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import torch
from conftest import REPO

WRITER = """
import sys, torch
from hybridtrain.engine import checkpoint
from hybridtrain.files import replace_file
from hybridtrain.files import append_json_line, write_text_atomically
folder = sys.argv[1]
texts = ["A" * 1_000_000, "B" * 1_500_000]
tensors = [torch.zeros(300_000), torch.ones(400_000)]
print("ready", flush=True)
i = 0
while True:
    write_text_atomically(folder + "/config.yaml", texts[i % 2])
    replace_file(folder + "/rank-0-error.log", texts[i % 2])
    checkpoint.atomic_save({"w": tensors[i % 2]}, folder + "/final_model.pt")
    append_json_line(folder + "/metrics.jsonl", {"epoch": i, "pad": texts[i % 2][:300_000]})
    i += 1
"""


def test_a_writer_killed_mid_write_leaves_the_old_file_or_the_new_one(tmp_path):
    rng = random.Random(0)
    seen, digests, sums = set(), set(), set()
    for kill in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 1.5))  # the loop is all writes: a kill lands inside one
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        for name in ("config.yaml", "rank-0-error.log"):
            text = tmp_path / name
            if text.exists():
                content = text.read_text()
                assert content in ("A" * 1_000_000, "B" * 1_500_000), (kill, name, len(content))
                seen.add((name, content[0]))
        model = tmp_path / "final_model.pt"
        if model.exists():  # whole, and its .sha256 is its own or gone (a kill between the renames), never the other's
            w = torch.load(model, weights_only=True)["w"]
            assert (w.numel(), float(w.sum())) in ((300_000, 0.0), (400_000, 400_000.0)), kill
            digest = hashlib.sha256(model.read_bytes()).hexdigest()
            digests.add(digest)
            sidecar = tmp_path / "final_model.pt.sha256"
            if sidecar.exists():
                assert sidecar.read_text().split()[0] == digest, kill
                sums.add(digest)
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines() if (tmp_path / "metrics.jsonl").exists() else []
        for line in lines:  # appended records: each line whole
            record = json.loads(line)
            assert record["pad"] == ("A" if record["epoch"] % 2 == 0 else "B") * 300_000, kill
    assert {c for _, c in seen} == {"A", "B"}  # the kills landed at different points of the alternation
    assert len(digests) == 2 and sums  # both versions seen, a sum beside the file
    whole = ("config.yaml", "rank-0-error.log", "final_model.pt", "final_model.pt.sha256", "metrics.jsonl")
    leftovers = [n for n in os.listdir(tmp_path) if n not in whole]
    assert all(n.startswith((".config.yaml.", ".rank-0-error.log.")) or ".tmp-" in n for n in leftovers), leftovers


def test_a_killed_saves_temp_files_go_at_the_next_start(small_digits, tmp_path, write_config):
    """The writer killed mid-write in a run folder leaves temp files (final_model.pt.tmp-PID, .config.yaml.XXXXXXXX.yaml,
    ...); the next train into that folder removes every one of them as it claims the folder (here it then refuses:
    the folder holds another run's files), and leaves the files that are whole."""
    from conftest import HYBRIDTRAIN, assert_one_error_line, run, tiny_config
    folder = tmp_path / "run"
    folder.mkdir()
    rng = random.Random(1)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    (folder / f"final_model.pt.tmp-{proc.pid}").write_bytes(b"half a model")  # the kill inside final_model's save
    (folder / ".report.md.a1b2c3d4.md").write_text("half a report")  # and inside the report's
    left = [n for n in os.listdir(folder) if ".tmp-" in n or n.startswith((".config.yaml.", ".report.md."))]
    assert f"final_model.pt.tmp-{proc.pid}" in left
    config = write_config(tiny_config(small_digits, str(folder)), "train.yaml")
    assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", config]), "holds another run's files")
    assert not [n for n in os.listdir(folder) if ".tmp-" in n or n.startswith((".config.yaml.", ".report.md."))]
    assert {"final_model.pt", "config.yaml"} <= set(os.listdir(folder))
