"""The robustness corpus: bad environments and launches give one clear error line, and docs/robustness.md lists
every bad input with the test that proves its behaviour. Real processes, real launchers, no mocks."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import HYBRIDTRAIN, REPO, assert_one_error_line, env_with_venv, horovodrun, run, tiny_config

ROBUSTNESS_DOC = os.path.join(REPO, "docs", "robustness.md")
AREAS = {"config", "data", "checkpoint", "command line", "environment"}
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no MPI (apt-get install openmpi-bin)")


def run_with_env(cmd: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(env_with_venv(), **extra_env),
                          cwd=REPO, stdin=subprocess.DEVNULL)


def mpirun(np_: int, *args: str) -> list[str]:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return ["mpirun", *root, "--oversubscribe", "-np", str(np_), *args]


def test_unknown_horovod_controller_is_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run")))
    proc = run_with_env([HYBRIDTRAIN, "train", "--config", cfg], HOROVOD_CONTROLLER="nccl")
    assert_one_error_line(proc, "HOROVOD_CONTROLLER=nccl is not a Horovod controller", "mpi or gloo")


@needs_mpirun
def test_gloo_controller_under_mpirun_is_one_line(small_digits, tmp_path, write_config):
    """Without the check Horovod aborts inside hvd.init() with MPI_ERR_COMM and no word on the cause."""
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run")))
    proc = run(mpirun(2, "-x", "HOROVOD_CONTROLLER=gloo", HYBRIDTRAIN, "train", "--config", cfg))
    assert_one_error_line(proc, "HOROVOD_CONTROLLER=gloo needs the rendezvous", "horovodrun --gloo")


# Started by one MPI's mpirun, a Horovod built against another MPI ignores that launcher's variables and every
# process initializes as rank 0 of a 1-rank job. Removing the variables through which Open MPI's own library
# joins the job (and keeping the OMPI_COMM_WORLD_* a foreign MPI would see and ignore) makes exactly that.
AS_IF_BUILT_WITH_ANOTHER_MPI = """
import os, sys
for name in [n for n in os.environ if n.startswith(("PMIX_", "OPAL_", "ORTE_", "OMPI_"))]:
    if not name.startswith("OMPI_COMM_WORLD_"):
        del os.environ[name]
os.execv(sys.argv[1], sys.argv[1:])
"""


@needs_mpirun
def test_mpi_mismatch_where_every_process_forms_its_own_job_is_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run")))
    proc = run(mpirun(2, sys.executable, "-c", AS_IF_BUILT_WITH_ANOTHER_MPI, HYBRIDTRAIN, "train", "--config", cfg))
    assert_one_error_line(proc, "the launcher started 2 processes but Horovod formed a 1-rank job",
                          "not the MPI Horovod was built with")
    assert not os.path.exists(tmp_path / "run"), "the ranks started training as separate jobs"


def test_too_many_ranks_for_the_data_is_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"batch_size": 128}))
    proc = horovodrun(2, ["train", "--config", cfg], timeout=300)
    assert_one_error_line(proc, "the training set (240 images) cannot give each of 2 rank(s) a full batch of 128",
                          "fewer ranks")


# ----------------------------------------------------------------------------------- docs/robustness.md

def robustness_rows() -> list[list[str]]:
    """The cells of the table's body rows: area | input | behaviour | tests."""
    with open(ROBUSTNESS_DOC) as fh:
        corpus = fh.read().split("## The corpus", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in corpus.splitlines() if line.strip().startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return [row for row in rows[2:] if len(row) == 4]  # past the header and its --- line


def defined_tests(path: str) -> set[str]:
    with open(path) as fh:
        tree = ast.parse(fh.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_robustness_table_lists_25_inputs_across_all_areas_each_with_a_real_test():
    rows = robustness_rows()
    inputs = [row[1] for row in rows]
    assert len(set(inputs)) == len(inputs) >= 25, "at least 25 distinct bad inputs"
    assert {row[0] for row in rows} == AREAS
    for area, bad_input, behaviour, tests in rows:
        ids = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`", tests)
        assert ids and behaviour, f"row '{bad_input}' names no test or behaviour"
        for path, name in ids:
            assert name in defined_tests(os.path.join(REPO, path)), f"row '{bad_input}': {path}::{name} does not exist"


@pytest.mark.parametrize("command, broken", [
    (["report", "{run}"], "hybridtrain.reports.report:report_run"),
    (["experiment", "optimizers", "--out", "{run}"], "tools.experiments:run_experiment"),
], ids=["report", "experiment"])
def test_a_bugs_crash_log_goes_into_the_commands_run_folder(tmp_path, command, broken):
    """A bug (an unexpected error) in a command that has a run folder: one line naming the log, and the traceback in
    that folder's logs/, not in the system's temp folder."""
    folder = tmp_path / "run"
    folder.mkdir()
    script = os.path.join(REPO, "tests", "scripts", "with_a_bug.py")
    argv = [a.replace("{run}", str(folder)) for a in command]
    proc = subprocess.run([sys.executable, script, broken, *argv], capture_output=True, text=True, timeout=120,
                          env=env_with_venv(1), cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    log = folder / "logs" / "rank-0-error.log"
    assert_one_error_line(proc, "unexpected ZeroDivisionError", str(log))
    assert "ZeroDivisionError" in log.read_text() and "Traceback" in log.read_text()
