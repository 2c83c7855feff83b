"""``hybridtrain gpu-check`` on the CPU: the one-line refusals as real processes; the plan and its calls; the row
matrix (every program a real path, torchrun as a module, every training row a valid config); rows as real
processes whose table survives a failed, a killed and a stopped row; the background build; a second call;
the resume row's driver on the torch engine; ``make gpu-bundle``; and ``--rehearse`` with the network cut.
What only a GPU shows (the rows' figures) is in docs/benchmarks.md."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from conftest import HYBRIDTRAIN, REPO, assert_one_error_line, run, tiny_config, venv_without

from hybridtrain.gpucheck import check as gc
from hybridtrain.gpucheck import results
from hybridtrain.gpucheck import rows as gr
from hybridtrain.gpucheck.probe import no_gpu_reason

PY = gr.Pythons("/image/bin/python", "/gpu-venv/bin")


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- refusals, before any work

@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the check runs instead of refusing")
def test_no_gpu_is_one_line_exit_2_and_nothing_written(tmp_path):
    out = tmp_path / "check"
    proc = run([HYBRIDTRAIN, "gpu-check", "--out", str(out)], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("hybridtrain: error: gpu-check needs a CUDA GPU and torch cannot use one here (")
    assert proc.stderr.strip().endswith("): run it on a GPU node") and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stdout + proc.stderr and proc.stdout == ""
    assert not out.exists()  # refused before any work


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the check runs instead of refusing")
def test_a_bare_python_with_torch_alone_runs_the_checkout_and_refuses_in_one_line(tmp_path):
    """The lent machine's start: torch, no PyYAML, no Horovod, hybridtrain not installed (python -m from the
    checkout); the command must get as far as its own checks."""
    python = venv_without(str(tmp_path / "bare"), ["yaml", "_yaml", "pyyaml-*", "horovod", "horovod-*", "tqdm",
                                                   "__editable__*", "hybridtrain-*"])
    proc = run([python, "-m", "hybridtrain", "gpu-check", "--out", str(tmp_path / "out")], timeout=120)
    assert proc.returncode == 2 and "gpu-check needs a CUDA GPU" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_driver_too_old_for_torchs_cuda_is_named_not_no_gpu():
    """Review 3 #5: a cu130 torch on an r550 driver (CUDA 12.4) says so, not 'no GPU'."""
    line = no_gpu_reason("13.0", 12040, "CUDA does not initialise (driver too old)")
    assert "driver supports CUDA 12.4" in line and "CUDA 13.0" in line and "r580" in line
    assert no_gpu_reason("13.0", 13000, "no GPU is visible") == "no GPU is visible"
    assert no_gpu_reason("", 0, "a CPU-only build") == "a CPU-only build"


@pytest.mark.parametrize("below, needle", [("", "is a file, not a folder"), ("sub", "cannot be created")],
                         ids=["out-is-a-file", "parent-is-a-file"])
def test_a_bad_out_folder_is_refused_first(tmp_path, below, needle):
    (tmp_path / "taken").write_text("x")
    out = tmp_path / "taken" / below if below else tmp_path / "taken"
    proc = run([HYBRIDTRAIN, "gpu-check", "--out", str(out), "--bundle", str(tmp_path / "nowhere")], timeout=120)
    assert proc.returncode == 2
    assert_one_error_line(proc, "--out", needle)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_out_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert_one_error_line(run([HYBRIDTRAIN, "gpu-check", "--out", str(locked / "out")], timeout=120),
                              "is not writable by this user", "choose another folder")
    finally:
        locked.chmod(stat.S_IRWXU)


@pytest.mark.parametrize("args, needles", [
    (["--bundle", "{tmp}/wheels"], ["--bundle", "has no horovod-0.28.1.tar.gz", "make gpu-bundle"]),
    (["--gpus", "2"], ["--gpus is for --plan"]),
    (["--rehearse", "--archive", "{tmp}/back"], ["--archive brings a GPU call's results back", "drop --archive"]),
    (["--plan", "--archive", "{tmp}/back"], ["--archive does nothing with --plan", "drop --archive"]),
    (["--plan", "--fresh", "--budget-s", "60"], ["--budget-s, --fresh do nothing with --plan",
                                                 "drop --budget-s and --fresh"]),
    (["--rehearse", "--fresh"], ["--fresh does nothing with --rehearse", "drop --fresh"]),
], ids=["bundle-without-sdist", "gpus-without-plan", "archive-with-rehearse", "archive-with-plan",
        "budget-and-fresh-with-plan", "fresh-with-rehearse"])
def test_bad_options_are_refused_in_one_line_before_any_work(tmp_path, args, needles):
    (tmp_path / "wheels").mkdir()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = run([HYBRIDTRAIN, "gpu-check", "--out", str(tmp_path / "out"), *argv], timeout=120)
    assert proc.returncode == 2
    assert_one_error_line(proc, *needles)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the plan

def test_the_plan_prints_every_row_with_its_estimate_and_call_without_torch(tmp_path):
    """--plan needs no GPU and no torch: a venv without torch prints it."""
    python = venv_without(str(tmp_path / "no-torch"), ["torch", "torch-*", "torchvision", "torchvision-*"])
    proc = run([python, "-m", "hybridtrain", "gpu-check", "--plan"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = gr.plan_calls(gr.build_rows(1, "OUT", gr.Pythons(horovod_bin="VENV/bin")))
    table = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [cells[2].strip() for cells in table[1:]] == [r.name for r in rows]
    totals = {int(m[1]): (float(m[2]), float(m[3])) for m in
              re.finditer(r"^call (\d+): (\d+) s of rows estimated \(budget (\d+) s\)$", proc.stdout, re.M)}
    assert totals[1][0] <= 480 and totals[1][1] == 480 and totals[2][0] <= 240 and totals[2][1] == 240
    assert sum(1 for cells in table[1:] if cells[5].strip() == "1") >= 6  # the first call is not empty
    assert "not covered by one GPU:" in proc.stdout and "NCCL across ranks" in proc.stdout


def test_calls_are_packed_by_the_runners_own_order_hand_worked():
    """Preamble 20 s, build 150 s (done at 170 s), budgets 400 and 250: A (100) to 120 s; B needs Horovod, not
    ready, so C (200) runs to 320 s; B (50) then fits to 370 s; D (300) fits neither call."""
    rows = [gr.Row("A", "train", estimate_s=100), gr.Row("B", "train", horovod=True, estimate_s=50),
            gr.Row("C", "train", estimate_s=200), gr.Row("D", "train", estimate_s=300),
            gr.Row("E", "note", status="not run")]
    gr.plan_calls(rows, build_s=150, budgets=(400, 250), preamble_s=20)
    assert [r.call for r in rows] == ["1", "1", "1", "later", ""]
    rows = [gr.Row("A", "train", estimate_s=300), gr.Row("B", "train", estimate_s=200)]
    gr.plan_calls(rows, build_s=150, budgets=(400, 250), preamble_s=20)
    assert [r.call for r in rows] == ["1", "2"]  # 20 + 300 + 200 > 400; call 2: 20 + 200 <= 250


def test_call_one_alone_answers_the_issues_questions_in_its_order_within_480_s():
    """Issue 41: the whole step against the plain AMP loop (fp16, bf16) on both engines, a run with an exact resume,
    the ResNet-50 step with CUDA graphs and with compile, the largest batch: all in call 1, listed in that order."""
    for gpus in (1, 2):
        rows = gr.plan_calls(gr.build_rows(gpus, "OUT", PY))
        first = [r.name for r in rows if r.call == "1"]
        assert first == ["bench-mixed-fp16", "bench-mixed-bf16", "resume-mixed-fp16-torch",
                         "bench-mixed-fp16-horovod", "bench-mixed-fp16-graphed", "bench-mixed-bf16-compiled",
                         "max-batch-mixed-bf16"]
        assert gr.PREAMBLE_S + sum(r.estimate_s for r in rows if r.call == "1") <= 480 == gr.CALL_BUDGETS_S[0]
        assert gr.PREAMBLE_S + sum(r.estimate_s for r in rows if r.call == "2") <= gr.CALL_BUDGETS_S[1]
        assert "train-1rank-mixed-fp16-graphed" in [r.name for r in rows if r.call == "2"]
    from hybridtrain.cli import build_parser  # the command's default budget is call 1's
    assert build_parser().parse_args(["gpu-check"]).budget_s == gr.CALL_BUDGETS_S[0]


# ----------------------------------------------------------------------------- the row matrix

def names(rows):
    return [r.name for r in rows]


def test_one_gpu_rows_use_the_image_python_torchrun_as_a_module_and_the_build_for_horovod(tmp_path):
    rows = gr.build_rows(1, str(tmp_path), PY)
    runnable = [r for r in rows if r.kind != "note"]
    assert all(r.argv[0] in (PY.image, PY.hvd("python"), PY.hvd("horovodrun")) for r in runnable)
    assert not any("torchrun" in a for r in rows for a in r.argv)  # review 3 #1: no torchrun script assumed
    assert all((r.argv[0] == PY.image) != r.horovod for r in runnable)
    torch_rows = [r for r in runnable if r.name.endswith("-torch") and r.kind == "train"]
    assert torch_rows and all(r.argv[1:4] == ["-m", "torch.distributed.run", "--standalone"] for r in torch_rows)
    (gloo,) = [r for r in rows if "gloo" in r.name]  # review 3 #8: DDP + FP16 hook on 2 ranks of one GPU
    assert gloo.ranks == 2 and gloo.env == {"HYBRIDTRAIN_TORCH_BACKEND": "gloo"} and gloo.precision == "mixed-fp16"
    assert "--nproc-per-node=2" in gloo.argv
    notes = {r.name: r.detail for r in rows if r.kind == "note"}
    assert "NCCL refuses two ranks on one device" in notes["train-2ranks-mixed-bf16-eager"]
    assert "cannot travel" in notes["train-1rank-mixed-bf16-dali-torch"]
    assert names(rows)[:3] == ["bench-mixed-fp16", "bench-mixed-bf16", "resume-mixed-fp16-torch"]
    first = rows[0].argv
    assert first[first.index("--engine") + 1] == "torch" and "--baseline" in first and "--channels-last" in first
    assert len(set(names(rows))) == len(rows)  # one log per row


def test_two_gpus_run_nccl_on_two_ranks_of_both_engines(tmp_path):
    rows = gr.build_rows(2, str(tmp_path), PY, dali=True)
    two = [r for r in rows if r.ranks == 2]
    assert {r.name for r in two} == {"train-2ranks-mixed-fp16-eager-torch", "train-2ranks-mixed-bf16-eager",
                                     "train-2ranks-fp32-eager"}
    assert not any(r.env for r in two) and not [r for r in rows if r.kind == "note"]
    (dali,) = [r for r in rows if "dali" in r.name]
    assert dali.before[0][-3:-1] == ["synthetic-imagenet", "--out"]


def test_every_row_passes_its_engines_own_checks_and_a_refused_row_is_named(tmp_path):
    """Review 4 #1: row 7 (the torch engine with CUDA graphs) was refused by the engine once its model was built.
    Every row of every machine shape passes its engine's check_config; a refused one is named with its line, by
    the function in process and by the rehearsal's step as a real process."""
    from hybridtrain.gpucheck import rehearsal
    rows = gr.build_rows(2, str(tmp_path), PY, dali=True) + gr.build_rows(1, str(tmp_path), PY)
    assert {rehearsal.row_engine(r) for r in rows} >= {"torch", "horovod"}
    assert rehearsal.engine_refusals(rows) == {}
    refused = gr.train_row(PY, str(tmp_path), "mixed-bf16", "graphed", 1, engine="torch")
    assert list(rehearsal.engine_refusals(rows + [refused])) == [refused.name]
    step = rehearsal.check_engines([rows[0], refused], sys.executable, str(tmp_path), dict(os.environ))
    assert step.status == gr.FAIL
    log = (tmp_path / "engine-checks.log").read_text()
    assert f"{refused.name}: train.cuda_graphs runs on the Horovod engine only" in log and "1 of 2 rows" in log


def test_row_starts_pass_a_row_that_runs_or_wants_the_gpu_and_fail_one_that_breaks(tmp_path):
    from hybridtrain.gpucheck import rehearsal
    wants = "import sys; print('[0]<stderr>:hybridtrain: error: train.device=cuda but CUDA is unusable'); " \
            "print('Traceback (most recent call last):'); sys.exit(1)"
    rows = [py_row("runs", "import time; time.sleep(60)"), py_row("wants-gpu", wants), py_row("ok", "pass"),
            py_row("breaks", "import sys; print('hybridtrain: error: no such option --fast'); sys.exit(2)")]
    started = time.monotonic()
    step = rehearsal.start_rows(rows, str(tmp_path), dict(os.environ))
    assert step.status == gr.FAIL and step.detail == "breaks: exit 2: hybridtrain: error: no such option --fast"
    assert time.monotonic() - started < rehearsal.START_S + 20  # the sleeper was stopped, side by side
    assert rehearsal.start_rows(rows[1:3], str(tmp_path), dict(os.environ)).status == gr.PASS


def test_every_training_row_is_a_valid_config_of_the_h100_recipe(tmp_path):
    from hybridtrain.config import load_config
    for row in gr.build_rows(2, str(tmp_path), PY, dali=True) + gr.build_rows(1, str(tmp_path), PY):
        if row.kind not in ("train", "resume"):
            continue
        sets = [row.argv[i + 1] for i, a in enumerate(row.argv) if a == "--set"]
        cfg = load_config(os.path.join(REPO, gr.RECIPE), sets)
        assert cfg.data.channels_last and cfg.train.epochs == gr.EPOCHS and cfg.train.device == "cuda"
        assert cfg.train.compile == (row.mode == "compiled") and cfg.train.cuda_graphs == (row.mode == "graphed")
        assert cfg.precision.mode == row.precision.split("-")[0]
        if row.kind == "resume":
            assert cfg.train.deterministic
        else:
            assert cfg.run_dir == row.output


# ----------------------------------------------------------------------------- figures

def records(*rates, reserved=True):
    keys = {"peak_memory_reserved_mb": 900.0} if reserved else {}
    return [{"epoch": i + 1, "images_per_sec": rate, "train_time_s": 2.0, "train_loss": 6.9, "world_size": 1,
             "val_top1": 0.001, "peak_memory_mb": 700.0 + i, **keys} for i, rate in enumerate(rates)]


def test_steady_rate_leaves_out_the_first_epoch_and_absent_memory_keys_are_none():
    figures = results.train_figures(records(10.0, 1000.0, 1200.0, reserved=False))
    assert figures["images_per_sec"] == pytest.approx(1100.0)
    assert figures["peak_allocated_mb"] == 702.0
    assert figures["peak_reserved_mb"] is None and figures["device_used_mb"] is None


def test_a_train_row_is_judged_from_its_metrics_file(tmp_path):
    row = gr.train_row(PY, str(tmp_path), "mixed-bf16", "eager", 1)
    os.makedirs(row.output)
    with open(os.path.join(row.output, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records(50.0, 2500.0))
    assert results.read_train(row) == "" and row.images_per_sec == 2500.0 and row.peak_reserved_mb == 900.0
    with open(os.path.join(row.output, "metrics.jsonl"), "w") as fh:
        fh.write(json.dumps(records(50.0)[0]) + "\n")
    assert results.read_train(row) == "1 of 2 epochs in metrics.jsonl"
    with open(os.path.join(row.output, "metrics.jsonl"), "w") as fh:
        fh.write('{"epoch": 1}\n' + json.dumps(records(50.0)[0]) + "\n")  # a damaged line, not the last
    assert results.read_train(row).startswith("unreadable metrics.jsonl (") and "line 1" in results.read_train(row)
    for name in ("checkpoint-epoch0002.pt", "checkpoint-epoch0002.pt.sha256", "final_model.pt"):
        open(os.path.join(row.output, name), "w").close()
    results.drop_weights(row.output)  # hundreds of MiB per ResNet-50 row; the figures stay
    assert sorted(os.listdir(row.output)) == ["metrics.jsonl"]


def test_bench_rows_read_the_plain_loop_and_the_whole_step_of_each_engine(tmp_path):
    torch_row, hvd_row = gr.bench_row(PY, str(tmp_path), "mixed-fp16"), gr.bench_row(
        PY, str(tmp_path), "mixed-fp16", "horovod")
    graphed = gr.bench_row(PY, str(tmp_path), "mixed-fp16", "graphed")
    with open(graphed.output, "w") as fh:
        json.dump([{"loop": "trainer", "images_per_sec": 3000.0, "host_syncs_per_step": 1}], fh)
    with open(torch_row.output, "w") as fh:
        json.dump([{"loop": "trainer", "images_per_sec": 2400.0, "host_syncs_per_step": 1},
                   {"loop": "train/torch", "images_per_sec": 2300.0, "over_baseline": 0.92},
                   {"loop": "baseline", "images_per_sec": 2500.0, "trainer_over_baseline": 0.96}], fh)
    with open(hvd_row.output, "w") as fh:
        json.dump([{"loop": "trainer", "images_per_sec": 2400.0},
                   {"loop": "train/horovod", "images_per_sec": 2250.0, "peak_memory_mb": 11000.0}], fh)
    assert results.read_bench(torch_row) == "" and results.read_bench(hvd_row) == "" and results.read_bench(graphed) == ""
    assert (torch_row.images_per_sec, torch_row.ratio) == (2400.0, 0.96)
    assert torch_row.detail == ("plain loop 2500 img/s; host syncs/step 1; whole step under torchrun 2300 img/s "
                                "(0.920x)")
    assert hvd_row.images_per_sec == 2250.0 and hvd_row.peak_allocated_mb == 11000.0
    torch_row.status = hvd_row.status = graphed.status = gr.PASS
    shared = gr.Row("train-2ranks-shared", "train", precision="mixed-fp16", ranks=2, images_per_sec=4000.0)
    results.fill_ratios([torch_row, hvd_row, graphed, shared], gpus=1)
    assert hvd_row.ratio == pytest.approx(2250.0 / 2500.0) and graphed.ratio == pytest.approx(3000.0 / 2500.0)
    assert shared.ratio is None  # review 4 #7: two ranks on one GPU get no per-GPU ratio
    results.fill_ratios([torch_row, shared], gpus=2)
    assert shared.ratio == pytest.approx(4000.0 / 2 / 2500.0)


def test_the_gpu_tests_row_is_judged_by_pytests_own_junit_report(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_good():\n    pass\n\ndef test_bad():\n    assert 0\n")
    row = gr.tests_row(gr.Pythons(sys.executable, os.path.dirname(sys.executable)), str(tmp_path))
    assert "--timeout=120" in row.argv and row.output == str(tmp_path / "gpu-tests.xml")
    argv = row.argv[:row.argv.index("--timeout=120") + 2] + [str(tmp_path / "test_two.py")]  # its report, these tests
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    assert results.read_junit(row) == "failed: test_bad" and row.detail == "1 passed, 1 failed, 0 skipped"
    assert results.read_junit(gr.Row("gpu-tests", "tests", output=str(tmp_path / "none.xml"))).startswith("no JUnit")


def test_max_batch_and_bench_optim_rows_read_their_outputs(tmp_path):
    row = gr.max_batch_row(PY)
    log = tmp_path / "max.log"
    log.write_text("| batch | images/s | peak MiB | fits |\n| 1792 | 2762.8 | 75885 | yes |\n"
                   "| 1816 (largest) | 2761.2 | 76900 | yes |\n")
    assert results.read_max_batch(row, str(log)) == "" and row.detail.startswith("largest batch 1816: 2761.2 img/s")
    assert results.read_max_batch(row, str(tmp_path / "none.log")) == "no (largest) row in the output"
    optim = gr.bench_optim_row(PY, str(tmp_path))
    with open(optim.output, "w") as fh:
        json.dump([{"optimizer": "sgd-foreach", "median_ms": 4.0, "ratio_to_sgd": 1.0},
                   {"optimizer": "hybrid/adabound", "median_ms": 9.0, "ratio_to_sgd": 2.25}], fh)
    assert gc.judge(optim, 0, str(tmp_path / "bench-optim.log")) == ""
    assert optim.detail == "SGD 4.00 ms; ÷ SGD: hybrid/adabound 2.25x"


# ----------------------------------------------------------------------------- rows as real processes

def py_row(name: str, code: str, timeout: float = 30, **kw) -> gr.Row:
    return gr.Row(name, "step", [sys.executable, "-c", code], timeout, **kw)


def test_a_row_runs_as_a_real_process_with_its_log_and_its_timeout(tmp_path):
    ok = py_row("echo", "print('1 passed in 0.1s')")
    slow = py_row("sleeper", "import time; print('waiting', flush=True); time.sleep(60)", 2)
    deadline = time.monotonic() + 100
    gc.run_row(ok, str(tmp_path), deadline, dict(os.environ), lambda line: None)
    started = time.monotonic()
    gc.run_row(slow, str(tmp_path), deadline, dict(os.environ), lambda line: None)
    assert ok.status == gr.PASS
    assert slow.status == gr.FAIL and slow.detail.startswith("timed out after 2 s") and time.monotonic() - started < 20
    assert "waiting" in (tmp_path / "sleeper.log").read_text() and "1 passed" in (tmp_path / "echo.log").read_text()
    late = py_row("late", "pass", estimate_s=60)
    gc.run_row(late, str(tmp_path), time.monotonic() + 30, dict(os.environ), lambda line: None)
    assert late.status == gr.NOT_RUN and late.detail.startswith(gr.NEXT_CALL)
    cut = py_row("cut", "import time; time.sleep(60)", 50, estimate_s=1)  # review 4 #4: the budget's end, not FAIL
    gc.run_row(cut, str(tmp_path), time.monotonic() + gc.MIN_ROW_S + 2, dict(os.environ), lambda line: None)
    assert cut.status == gr.NOT_RUN and cut.detail.startswith(f"{gr.NEXT_CALL} (stopped at the end of the budget")
    text = results.write_results([ok, late, cut], str(tmp_path), {})
    assert text.startswith("# hybridtrain gpu-check: every row that ran passed; 2 rows left for the next call")


def test_a_missing_program_fails_its_row_not_the_check(tmp_path):
    """Review 3 #1: Popen's FileNotFoundError is the row's failure."""
    row = gr.Row("gone", "train", [str(tmp_path / "venv" / "bin" / "torchrun")], 30, output=str(tmp_path / "run"))
    gc.run_row(row, str(tmp_path), time.monotonic() + 60, dict(os.environ), lambda line: None)
    assert row.status == gr.FAIL and row.detail.startswith("could not start:") and "torchrun" in row.detail


def test_the_table_survives_a_failed_and_a_killed_row_and_is_written_after_every_row(tmp_path):
    out = str(tmp_path)
    rows = [py_row("first", "print('ok')"),
            py_row("reads-the-table", f"import json; d = json.load(open({out + '/gpu_check.json'!r})); "
                                      f"assert d['rows'][0]['status'] == 'pass', d['rows'][0]"),
            py_row("fails", "import sys; sys.exit(3)"),
            py_row("killed", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
            py_row("after", "print('still runs')")]
    write = lambda: results.write_results(rows, out, {"device": "cpu"})
    text = gc.execute(rows, out, time.monotonic() + 120, dict(os.environ), None, write, lambda line: None)
    assert [r.status for r in rows] == [gr.PASS, gr.PASS, gr.FAIL, gr.FAIL, gr.PASS]
    assert rows[2].detail.startswith("exit status 3") and rows[3].detail.startswith("exit status -9")
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["failed"] == ["fails", "killed"] and len(saved["rows"]) == 5
    assert text.startswith("# hybridtrain gpu-check: FAILED (fails, killed)") and "Not covered here:" in text
    assert (tmp_path / "gpu_check.md").read_text() == text


def test_a_check_stopped_by_sigterm_keeps_the_rows_that_ended_and_stops_the_running_one(tmp_path):
    marker = tmp_path / "grandchild.pid"
    script = textwrap.dedent(f"""
        import os, sys, time
        from hybridtrain.gpucheck import check as gc, results, rows as gr
        out = {str(tmp_path)!r}
        rows = [gr.Row("done", "step", [sys.executable, "-c", "pass"], 30),
                gr.Row("long", "step", [sys.executable, "-c", "import os, time; open({str(marker)!r}, 'w').write("
                       "str(os.getpid())); time.sleep(120)"], 300)]
        write = lambda: results.write_results(rows, out, {{}})
        gc.execute(rows, out, time.monotonic() + 300, dict(os.environ), None, write, print)
        print("after", rows[1].status, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopped by SIGTERM" in stdout and "after not run" in stdout
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["status"] for r in saved["rows"]] == [gr.PASS, gr.NOT_RUN]
    assert saved["rows"][1]["detail"] == f"{gr.NEXT_CALL} (stopped by SIGTERM)" and saved["failed"] == []
    with pytest.raises(ProcessLookupError):  # the row's process did not outlive the check
        os.kill(int(marker.read_text()), 0)


def test_horovod_rows_wait_for_the_background_build_and_the_others_run_meanwhile(tmp_path):
    out = str(tmp_path)
    stamp = "import time; open({!r}, 'w').write(str(time.time()))"
    build = gc.Job(py_row("build", "import time; time.sleep(3)"), out, dict(os.environ), lambda line: None)
    rows = [py_row("horovod", stamp.format(str(tmp_path / "h")), horovod=True),
            py_row("plain", stamp.format(str(tmp_path / "p")))]
    gc.execute(rows, out, time.monotonic() + 120, dict(os.environ), build, lambda: "", lambda line: None)
    assert build.row.status == gr.PASS and [r.status for r in rows] == [gr.PASS, gr.PASS]
    assert float((tmp_path / "p").read_text()) < float((tmp_path / "h").read_text())
    failed = gc.Job(py_row("build", "import sys; sys.exit(1)"), out, dict(os.environ), lambda line: None)
    waiting = [py_row("horovod2", "pass", horovod=True)]
    gc.execute(waiting, out, time.monotonic() + 60, dict(os.environ), failed, lambda: "", lambda line: None)
    assert failed.row.status == gr.FAIL and waiting[0].status == gr.NOT_RUN
    assert waiting[0].detail.startswith("not run: no Horovod build")


def test_a_second_call_keeps_the_rows_that_passed(tmp_path):
    rows = [py_row("passed", "pass"), py_row("failed", "pass")]
    rows[0].status, rows[0].images_per_sec, rows[1].status = gr.PASS, 123.0, gr.FAIL
    results.write_results(rows, str(tmp_path), {})
    again = [py_row("passed", "pass"), py_row("failed", "pass")]
    assert results.take_earlier(again, results.earlier_rows(str(tmp_path))) == 1
    assert again[0].status == gr.PASS and again[0].images_per_sec == 123.0 and "earlier call" in again[0].detail
    assert again[1].status == "pending"


# ----------------------------------------------------------------------------- the resume row, on the CPU

def test_the_resume_driver_finds_a_resumed_torch_engine_run_bitwise_equal(tmp_path, small_digits):
    cfg = tiny_config(small_digits, str(tmp_path / "unused"), train={"epochs": 2, "batch_size": 16, "threads": 1,
                                                                     "progress": False, "device": "cpu"})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run([sys.executable, "-m", "hybridtrain.gpucheck.resume_check", "--out", str(tmp_path / "check"), "--engine",
                "torch", "--config", str(path), "--set", "train.deterministic=true"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "check" / "resume_check.json").read_text())
    assert result["equal"] and result["straight"].endswith("checkpoint-epoch0002.pt")
    row = gr.Row("resume", "resume", output=str(tmp_path / "check"))
    assert results.read_resume(row) == "" and row.images_per_sec


def test_the_resume_comparison_names_what_differs():
    import torch

    from hybridtrain.gpucheck.resume_check import differences
    a = {"model": {"w": torch.ones(2), "n": torch.tensor(3)}, "optimizer": {"state": {0: {"step": 1}}}}
    b = {"model": {"w": torch.tensor([1.0, 1.0 + 2**-20]), "n": torch.tensor(3)},
         "optimizer": {"state": {0: {"step": 2}}}}
    assert differences(a, a) == [] and differences(a, b) == ["/model/w", "/optimizer/state/0/step"]


# ----------------------------------------------------------------------------- the bundle and the rehearsal

def test_make_gpu_bundle_holds_the_build_for_python_3_12_and_fits_the_limit(tmp_path):
    proc = subprocess.run(["make", "-s", "gpu-bundle"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = os.listdir(os.path.join(REPO, ".gpu-bundle"))
    for prefix in ("horovod-0.28.1.tar.gz", "cffi-", "pycparser-", "setuptools-", "wheel-"):
        assert any(f.startswith(prefix) for f in files), (prefix, files)
    assert any(f.startswith("cffi-") and "-cp312-" in f for f in files)
    line = [s for s in proc.stdout.splitlines() if s.startswith("gpu-bundle:")][-1]
    total = float(line.split(") ")[-1].split(" MiB")[0])
    assert total < 64, line


@pytest.mark.timeout(1800)  # a first NCCL build on 2 cores: about 10 min; seconds once its wheel is cached
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="cutting the network needs root")
def test_the_rehearsal_passes_offline_from_a_venv_without_torchrun(tmp_path):
    """Review 3's reason for the issue: the first real call must not fail on its install or launch. The image-like
    venv has torch and setuptools (as KINDS.md lists the image) but no torchrun, Horovod or cffi; the build is Horovod with NCCL for sm_90 where
    nvcc and torch's NCCL wheel are here (the lent machine's combination, review 4 §3), and reuses this machine's
    wheel (HYBRIDTRAIN_CACHE) when its key matches; every row's config passes its engine's checks and every row's
    command starts."""
    bundle = os.path.join(REPO, ".gpu-bundle")
    if not os.path.isfile(os.path.join(bundle, "horovod-0.28.1.tar.gz")):
        subprocess.run(["make", "-s", "gpu-bundle"], cwd=REPO, check=True, timeout=300, stdin=subprocess.DEVNULL)
    out = tmp_path / "rehearsal"
    env = {**os.environ, "HYBRIDTRAIN_CACHE": os.path.join(os.path.expanduser("~"), ".cache", "hybridtrain")}
    offline = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']  # no network but loopback
    proc = subprocess.run([*offline, sys.executable, "-m", "hybridtrain", "gpu-check", "--rehearse", "--bundle",
                           bundle, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = (out / "rehearsal.md").read_text()
    for name in ("image-python", "build", "engine-checks", "command-line", "imports-image", "imports-horovod",
                 "imports-gpu-tests", "launch-torch-1rank", "launch-torch-2ranks", "launch-horovod-1rank",
                 "row-programs", "row-starts"):
        assert f"| {name} | pass |" in report, report
    assert not (out / "image-venv" / "bin" / "torchrun").exists()
    assert "install: ok" in (out / "build.log").read_text()
    from hybridtrain.gpucheck.rehearsal import nccl_build_possible
    if nccl_build_possible(sys.executable):  # this machine: nvcc 13 and nvidia-nccl-cu13 in the venv
        assert "| build | pass |" in report and "with NCCL for sm_90" in report
        assert "[X] NCCL" in subprocess.run([str(out / "horovod-venv" / "bin" / "horovodrun"), "--check-build"],
                                        capture_output=True, text=True, timeout=120).stdout
    starts = [f for f in os.listdir(out) if f.startswith("start-")]
    assert len(starts) == len([r for r in gr.build_rows(1, str(out), PY) if r.kind != "note"])


# ----------------------------------------------------------------------------- what comes back from the device

def documented_calls() -> dict[str, str]:
    """{'call 1': command line, ...}: the fenced lines under docs/benchmarks.md's '<!-- gpu-check call N' marks."""
    text = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    return {m[1]: m[2].strip() for m in re.finditer(r"<!-- gpu-check (call \d) \(timeout_s \d+\) -->\n```bash\n(.*?)```",
                                                   text, re.S)}


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the documented call would run the rows")
def test_the_documented_device_calls_fit_the_tool_and_write_their_archive_into_out(tmp_path):
    """Review 4 #2: the call runs as documented (from the checkout's root, `python3` the machine's), its command
    under the device tool's 2,000 characters, and what it found comes back as $OUT/gpu-check.tgz; here, on the
    CPU, that is the refusal's one line."""
    calls = documented_calls()
    assert set(calls) == {"call 1", "call 2"}
    for name, line in calls.items():
        assert len(line) < 2000 and "--archive \"$OUT\"" in line, name
        out = tmp_path / name.replace(" ", "")
        out.mkdir()
        python = os.path.dirname(sys.executable)  # python3 of the venv first, as on the lent machine
        proc = subprocess.run(["bash", "-c", line], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OUT": str(out), "PATH": python + os.pathsep + os.environ["PATH"]},
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 2 and "gpu-check needs a CUDA GPU" in proc.stderr, proc.stderr
        assert os.listdir(out) == ["gpu-check.tgz"]
        import tarfile
        with tarfile.open(out / "gpu-check.tgz") as tar:
            assert tar.getnames() == ["gpu-check/error.txt"]
            assert tar.extractfile("gpu-check/error.txt").read().decode() == proc.stderr
    assert "--budget-s 240" in calls["call 2"] and gr.CALL_BUDGETS_S[1] == 240


def test_the_archive_holds_the_table_logs_and_figures_under_16_mib_and_no_weights(tmp_path):
    out = tmp_path / "out"
    (out / "runs" / "row").mkdir(parents=True)
    (out / "image-venv").mkdir()
    (out / "gpu_check.md").write_text("# table\n")
    (out / "runs" / "row" / "metrics.jsonl").write_text("{}\n")
    (out / "runs" / "row" / "checkpoint-epoch0001.pt").write_bytes(b"w" * 1000)
    (out / "image-venv" / "pyvenv.cfg.log").write_text("venv")
    big = os.urandom(10 * 2**20)  # incompressible: two of them pass the limit
    (out / "build.log").write_bytes(big)
    (out / "bench.log").write_bytes(big[::-1] + b"\nlast line\n")
    path = results.write_archive(str(out), str(tmp_path / "back"))
    import tarfile
    assert os.path.getsize(path) <= results.ARCHIVE_LIMIT and os.listdir(tmp_path / "back") == ["gpu-check.tgz"]
    with tarfile.open(path) as tar:
        names = sorted(tar.getnames())
        assert names == ["gpu-check/bench.log", "gpu-check/build.log", "gpu-check/gpu_check.md",
                         "gpu-check/runs/row/metrics.jsonl"]
        log = tar.extractfile("gpu-check/bench.log").read()
        assert log.endswith(b"\nlast line\n") and len(log) == results.LOG_TAIL  # the end of a cut log is kept
