"""``hybridtrain gpu-check`` on the CPU: the one-line refusals (no GPU, a bad output folder) as real processes,
and the pure parts (the row matrix for 1 and 2 GPUs, the metrics reader, the table and its files) on real data.
What only a GPU shows (the build, the rows' figures) is in docs/benchmarks.md."""
from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import HYBRIDTRAIN, REPO, assert_one_error_line, run, venv_without

from hybridtrain.perf import gpu_check as gc


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- refusals, before any work

@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the check runs instead of refusing")
def test_no_gpu_is_one_line_exit_2_and_nothing_written(tmp_path):
    out = tmp_path / "check"
    proc = run([HYBRIDTRAIN, "gpu-check", "--out", str(out)], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"hybridtrain: error: {gc.NO_GPU}", proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and proc.stdout == ""
    assert not out.exists()  # refused before any work


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the check runs instead of refusing")
def test_a_bare_python_with_torch_alone_runs_the_checkout_and_refuses_in_one_line(tmp_path):
    """The bare GPU machine's start: torch, no PyYAML, no Horovod, hybridtrain not installed (python -m from the
    checkout); the command must get as far as its own checks."""
    python = venv_without(str(tmp_path / "bare"), ["yaml", "_yaml", "pyyaml-*", "horovod", "horovod-*", "tqdm",
                                                   "__editable__*", "hybridtrain-*"])
    proc = run([python, "-m", "hybridtrain", "gpu-check", "--out", str(tmp_path / "out")], timeout=120)
    assert (proc.returncode, proc.stderr.strip()) == (2, f"hybridtrain: error: {gc.NO_GPU}"), proc.stderr


@pytest.mark.parametrize("below, needle", [("", "is a file, not a folder"), ("sub", "cannot be created")],
                         ids=["out-is-a-file", "parent-is-a-file"])
def test_a_bad_out_folder_is_refused_first(tmp_path, below, needle):
    (tmp_path / "taken").write_text("x")
    out = tmp_path / "taken" / below if below else tmp_path / "taken"
    proc = run([HYBRIDTRAIN, "gpu-check", "--out", str(out), "--wheelhouse", str(tmp_path / "nowhere")], timeout=120)
    assert proc.returncode == 2
    assert_one_error_line(proc, "--out", needle)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_out_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert_one_error_line(run([HYBRIDTRAIN, "gpu-check", "--out", str(locked / "out")], timeout=120),
                              "cannot write in", "give a writable folder")
    finally:
        locked.chmod(stat.S_IRWXU)


def test_a_wheelhouse_without_the_horovod_sdist_is_refused(tmp_path):
    (tmp_path / "wheels").mkdir()
    proc = run([HYBRIDTRAIN, "gpu-check", "--out", str(tmp_path / "out"), "--wheelhouse", str(tmp_path / "wheels")],
               timeout=120)
    assert_one_error_line(proc, "--wheelhouse", "has no horovod-0.28.1.tar.gz")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the row matrix

def names(rows):
    return [r.name for r in rows]


def test_one_gpu_matrix_runs_every_precision_and_mode_and_says_why_not_two_ranks(tmp_path):
    rows = gc.build_rows(1, False, str(tmp_path), "/venv/bin")
    trains = [r for r in rows if r.kind == "train" and not r.name.endswith("-torch")]
    assert {(r.precision, r.mode) for r in trains} == {(p, m) for p in gc.PRECISIONS for m in gc.MODES}
    assert all(r.ranks == 1 and r.argv[:6] == ["/venv/bin/horovodrun", "--gloo", "-np", "1", "-H", "localhost:1"]
               for r in trains)
    (note,) = [r for r in rows if r.kind == "note"]
    assert note.status == gc.NOT_RUN and "NCCL refuses two ranks on one device" in note.detail
    assert "CPU tests cover" in note.detail and note.argv == []
    assert [(r.precision, r.mode) for r in rows if r.kind == "bench"] == [
        ("mixed-fp16", "eager"), ("mixed-bf16", "eager"), ("mixed-fp16", "fused")]
    fused = next(r for r in rows if r.mode == "fused")
    assert fused.argv[-2:] == ["--set", "optim.fused=true"] and "--horovod" not in fused.argv
    (optimizer,) = [r for r in rows if r.kind == "bench-optim"]
    assert optimizer.argv[1:3] == ["bench-optim", "--fused"] and optimizer.output.endswith("bench-optim.json")
    (ddp,) = [r for r in rows if r.name.endswith("-torch")]  # the second engine once: DDP and NCCL on the GPU
    assert ddp.argv[:4] == ["/venv/bin/torchrun", "--standalone", "--nproc-per-node=1", "--no-python"]
    assert ddp.argv[ddp.argv.index("--engine") + 1] == "torch" and ddp.ranks == 1
    assert names(rows)[0] == "gpu-tests" and names(rows)[-1].endswith("-compiled")  # the slow compiles last
    assert len(set(names(rows))) == len(rows)  # one log per row


def test_two_gpus_add_a_two_rank_row_and_quick_keeps_one_precision_for_the_slow_modes(tmp_path):
    rows = gc.build_rows(2, True, str(tmp_path), "/venv/bin")
    (two, ddp) = [r for r in rows if r.ranks == 2]
    assert ddp.name.endswith("-torch") and "--nproc-per-node=2" in ddp.argv
    assert two.kind == "train" and two.argv[3:6] == ["2", "-H", "localhost:2"]
    assert f"data.synthetic_images={2 * gc.BATCH * gc.STEPS_PER_EPOCH}" in two.argv
    assert not [r for r in rows if r.kind == "note"]
    slow = {(r.precision, r.mode) for r in rows if r.kind == "train" and r.mode != "eager"}
    assert slow == {("mixed-bf16", "compiled"), ("mixed-bf16", "graphed")}
    assert len(rows) == len(gc.build_rows(1, True, str(tmp_path), "/venv/bin"))


def test_every_train_row_is_a_valid_config_of_the_h100_recipe(tmp_path):
    from hybridtrain.config import load_config
    for row in gc.build_rows(2, False, str(tmp_path), "/venv/bin"):
        if row.kind != "train":
            continue
        sets = [row.argv[i + 1] for i, a in enumerate(row.argv) if a == "--set"]
        cfg = load_config(os.path.join(REPO, gc.RECIPE), sets)
        assert (cfg.data.backend, cfg.data.channels_last, cfg.train.epochs) == ("synthetic", True, gc.EPOCHS)
        assert cfg.train.compile == (row.mode == "compiled") and cfg.train.cuda_graphs == (row.mode == "graphed")
        assert cfg.precision.mode == row.precision.split("-")[0] and cfg.run_dir == row.output


# ----------------------------------------------------------------------------- figures, table and files

def records(*rates, reserved=True):
    keys = {"peak_memory_reserved_mb": 900.0} if reserved else {}
    return [{"epoch": i + 1, "images_per_sec": rate, "train_time_s": 2.0, "train_loss": 6.9, "world_size": 1,
             "val_top1": 0.001, "peak_memory_mb": 700.0 + i, **keys} for i, rate in enumerate(rates)]


def test_steady_rate_leaves_out_the_first_epoch_and_absent_memory_keys_are_none():
    figures = gc.train_figures(records(10.0, 1000.0, 1200.0, reserved=False))
    assert figures["images_per_sec"] == pytest.approx(1100.0)
    assert figures["peak_allocated_mb"] == 702.0
    assert figures["peak_reserved_mb"] is None and figures["device_used_mb"] is None


def test_a_train_row_is_judged_from_its_metrics_file(tmp_path):
    row = gc.train_row("/venv/bin", str(tmp_path), "mixed-bf16", "eager", 1)
    os.makedirs(row.output)
    with open(os.path.join(row.output, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records(50.0, 2500.0))
    assert gc.read_train(row) == "" and row.images_per_sec == 2500.0 and row.peak_reserved_mb == 900.0
    with open(os.path.join(row.output, "metrics.jsonl"), "w") as fh:
        fh.write(json.dumps(records(50.0)[0]) + "\n")
    assert gc.read_train(row) == "1 of 2 epochs in metrics.jsonl"
    with open(os.path.join(row.output, "metrics.jsonl"), "w") as fh:
        fh.write('{"epoch": 1}\n' + json.dumps(records(50.0)[0]) + "\n")  # a damaged line, not the last
    assert gc.read_train(row).startswith("unreadable metrics.jsonl (") and "line 1" in gc.read_train(row)
    for name in ("checkpoint-epoch0002.pt", "checkpoint-epoch0002.pt.sha256", "final_model.pt"):
        open(os.path.join(row.output, name), "w").close()
    gc.drop_weights(row.output)  # hundreds of MiB per ResNet-50 row; the figures stay
    assert sorted(os.listdir(row.output)) == ["metrics.jsonl"]


def test_the_bench_optim_row_notes_each_optimizers_ratio_to_sgd(tmp_path):
    row = gc.bench_optim_row("/venv/bin", str(tmp_path))
    with open(row.output, "w") as fh:
        json.dump([{"optimizer": "sgd-foreach", "median_ms": 4.0, "ratio_to_sgd": 1.0},
                   {"optimizer": "hybrid/adabound", "median_ms": 9.0, "ratio_to_sgd": 2.25},
                   {"optimizer": "hybrid/adabound fused", "median_ms": 2.0, "ratio_to_sgd": 0.5}], fh)
    assert gc.judge(row, 0, str(tmp_path / "bench-optim.log")) == ""
    assert row.detail == "SGD 4.00 ms; ÷ SGD: hybrid/adabound 2.25x, hybrid/adabound fused 0.50x"
    os.remove(row.output)
    assert gc.read_bench_optim(row).startswith("no bench-optim JSON")


def test_table_and_json_carry_every_row_ratio_and_failure(tmp_path):
    rows = gc.build_rows(1, True, str(tmp_path), "/venv/bin")
    bench = next(r for r in rows if r.name == "bench-mixed-bf16")
    bench.status, bench.images_per_sec, bench.baseline_images_per_sec, bench.ratio = gc.PASS, 2400.0, 2500.0, 0.96
    train = next(r for r in rows if r.name == "train-1rank-mixed-bf16-eager")
    train.status, train.images_per_sec, train.peak_allocated_mb, train.seconds = gc.PASS, 2000.0, 20480.4, 41.2
    fp32 = next(r for r in rows if r.name == "train-1rank-fp32-eager")
    fp32.status, fp32.detail = gc.FAIL, "timed out after 120 s"
    fused = next(r for r in rows if r.name == "bench-mixed-fp16-fused")  # its own baseline never feeds a ratio
    fused.precision, fused.baseline_images_per_sec = "mixed-bf16", 1.0
    gc.fill_ratios(rows)
    assert train.ratio == pytest.approx(0.8) and fp32.ratio is None

    text = gc.write_results(rows, str(tmp_path), {"device": "NVIDIA H100 80GB HBM3", "gpus": 1})
    assert text.startswith("# hybridtrain gpu-check: FAILED (train-1rank-fp32-eager)")
    assert "| train-1rank-mixed-bf16-eager | 2000.0 | 0.800 | 20480 | n/a | n/a | pass | 41 |" in text
    assert "| train-1rank-fp32-eager | n/a | n/a | n/a | n/a | n/a | **FAIL** | n/a | timed out after 120 s |" in text
    assert "| train-2ranks-mixed-bf16-eager | n/a | n/a | n/a | n/a | n/a | not run | n/a | not run: one GPU" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == len(rows) + 2  # the header, its rule and one line per row
    assert (tmp_path / "gpu_check.md").read_text() == text
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["passed"] is False and saved["failed"] == ["train-1rank-fp32-eager"]
    assert saved["device"] == "NVIDIA H100 80GB HBM3"
    assert [r["name"] for r in saved["rows"]] == names(rows) and saved["rows"][1]["precision"] == "fp32"


def test_a_row_runs_as_a_real_process_with_its_log_and_its_timeout(tmp_path):
    import sys
    import time
    ok = gc.Row("echo", "tests", [sys.executable, "-c", "print('1 passed in 0.1s')"], 30)
    slow = gc.Row("sleeper", "tests", [sys.executable, "-c", "import time; print('waiting', flush=True); "
                                                             "time.sleep(60)"], 2)
    lines = []
    deadline = time.monotonic() + 100
    gc.run_row(ok, str(tmp_path), deadline, dict(os.environ), lines.append)
    started = time.monotonic()
    gc.run_row(slow, str(tmp_path), deadline, dict(os.environ), lines.append)
    assert ok.status == gc.PASS and ok.detail == "1 passed in 0.1s"
    assert slow.status == gc.FAIL and slow.detail.startswith("timed out after 2 s") and time.monotonic() - started < 20
    assert "waiting" in (tmp_path / "sleeper.log").read_text() and "1 passed" in (tmp_path / "echo.log").read_text()
    late = gc.Row("late", "tests", [sys.executable, "-c", "pass"], 30)
    gc.run_row(late, str(tmp_path), time.monotonic() + 5, dict(os.environ), lines.append)
    assert late.status == gc.FAIL and late.detail.startswith("not run: time budget spent")


def test_a_training_row_starts_from_an_empty_run_directory_and_fails_without_metrics(tmp_path):
    import sys
    import time
    run_dir = tmp_path / "runs" / "stale"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1}\n')  # an earlier check's: the trainer would refuse it
    row = gc.Row("stale", "train", [sys.executable, "-c", "pass"], 30, output=str(run_dir))
    gc.run_row(row, str(tmp_path), time.monotonic() + 60, dict(os.environ), lambda line: None)
    assert not run_dir.exists()
    assert row.status == gc.FAIL and row.detail == "no metrics.jsonl"


# ----------------------------------------------------------------------------- the node checks, first

def test_the_node_probe_is_valid_python_that_runs_check_node():
    compile(gc.NODE_PROBE % (gc.PRECISIONS,), "probe", "exec")
    assert "check_node(torch.device('cuda', 0), p)" in gc.NODE_PROBE


def test_an_fp32_refusal_ends_the_check_in_one_line():
    line = "Tesla V100 is sm_70 (Volta, e.g. V100), and this torch 2.13.0 has kernels only for sm_75: reinstall"
    with pytest.raises(gc.UserError, match="reinstall"):
        gc.node_row({"fp32": (line, []), "mixed-fp16": (line, []), "mixed-bf16": (line, [])})


def test_a_bf16_refusal_turns_its_rows_into_not_run(tmp_path):
    bf16 = "precision bf16 needs a GPU with native BF16 (compute capability 8.0 or newer)"
    warning = "warning: Tesla P40 (sm_61) computes FP16 at 1/64 of its FP32 rate"
    checks = {"fp32": ("", []), "mixed-fp16": ("", [warning]), "mixed-bf16": (bf16, [])}
    first = gc.node_row(checks)
    assert first.status == gc.PASS and bf16 in first.detail and warning in first.detail
    rows = gc.skip_refused(gc.build_rows(1, False, str(tmp_path), "/venv/bin"), checks)
    refused = [r for r in rows if r.precision == "mixed-bf16" and "2ranks" not in r.name]
    assert refused and all(r.status == gc.NOT_RUN and bf16 in r.detail and r.kind == "note" for r in refused)
    assert all(r.status == "pending" for r in rows if r.precision == "fp32")
