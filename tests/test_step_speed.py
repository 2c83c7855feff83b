"""Issue 9, speed: Horovod's tuning knobs taking effect on real 2-rank jobs, torch.compile on the CPU, the CUDA
graphs switch, and no host sync inside the training step."""
from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

from conftest import HOROVODRUN, REPO, run

KNOBS_SCRIPT = os.path.join(REPO, "tests", "scripts", "horovod_knobs.py")


# ----------------------------------------------------------------------------- Horovod knobs

def knobs_job(tmp_path, sets: list[str], launcher_flags: list[str] = ()) -> tuple[dict, list[str], str]:
    """(rank 0's record, the timeline's event names, the job's output) of horovod_knobs.py on 2 ranks."""
    out, timeline = tmp_path / "out.json", tmp_path / "timeline.json"
    args = [a for s in sets for a in ("--set", s)]
    proc = run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", "--timeline-filename", str(timeline),
                *launcher_flags, sys.executable, KNOBS_SCRIPT, str(out), *args], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = timeline.read_text().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    return json.loads(out.read_text()), [e.get("name") for e in events], proc.stdout + proc.stderr


def test_no_fusion_and_a_long_cycle_take_effect_over_the_launchers_flag(tmp_path):
    record, names, output = knobs_job(tmp_path, ["horovod.fusion_threshold_mb=0", "horovod.cycle_time_ms=100"],
                                      ["--cycle-time-ms", "2"])
    assert "MEMCPY_IN_FUSION_BUFFER" not in names and names.count("ALLREDUCE") > 0  # every tensor on its own
    assert statistics.median(record["round_s"]) >= 0.05  # each round waits for 100 ms cycles
    assert record["env"]["HOROVOD_CYCLE_TIME"] == "100"
    assert "HOROVOD_CYCLE_TIME=2.0 from the launcher is replaced by the config's 100" in output


def test_default_knobs_fuse_and_cycle_fast(tmp_path):
    record, names, _ = knobs_job(tmp_path, [])
    assert "MEMCPY_IN_FUSION_BUFFER" in names  # the round's tensors share the fusion buffer
    assert statistics.median(record["round_s"]) < 0.05


def test_autotune_writes_its_log(tmp_path):
    log = tmp_path / "autotune.csv"
    knobs_job(tmp_path, ["horovod.autotune=true", f"horovod.autotune_log={log}"])
    assert log.read_text().startswith("hierarchical_allreduce,")  # Horovod's tuner opened it: autotune is on


def test_autotune_log_without_autotune_is_one_line(tmp_path):
    from hybridtrain.config import load_config
    from hybridtrain.errors import UserError
    with pytest.raises(UserError, match="horovod.autotune_log is set but horovod.autotune is false"):
        load_config(None, [f"horovod.autotune_log={tmp_path / 'a.csv'}"])
