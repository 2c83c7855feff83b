"""Commands stopped and commands refused: SIGTERM and Ctrl-C leave no namespace, sshd or rank behind;
a broken engine plugin, or a run refused before its first epoch, is one line and no trace; the causes and
numbers in a line are true: a --set section mapping, a link rate tc cannot do, a read-only file system, a dangling
link; a command given no work says so; records and bounded options are judged before they are shown.
Real processes: ``hybridtrain`` killed at several points with real namespaces and signals, plugins written into
tmp_path, a read-only tmpfs in a mount namespace of its own."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import yaml
from conftest import (
    BENCHMARKS,
    HYBRIDTRAIN,
    REPO,
    TOOLS,
    assert_one_error_line,
    command,
    env_with_venv,
    error_lines,
    needs_cluster,
    tiny_config,
)
from PIL import Image
from test_report import write_run

from hybridtrain.config import load_config
from tools.cluster import netns as cluster

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")


def hybridtrain(*args: str, env: dict | None = None, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(command(args), capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=env or env_with_venv(1), stdin=subprocess.DEVNULL)


# ----------------------------------------------------------------------------- 3. SIGTERM and Ctrl-C leave nothing

def left_behind() -> list[str]:
    """The cluster's namespaces, its sshds and any rank of a scale row that still exist."""
    found = cluster.namespaces()
    for pattern in (cluster.STATE_DIR, "benchmarks.scaling"):  # an sshd's command line names its host key
        found += subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.splitlines()
    return found


def kill_when(args: list[str], ready, sig: int, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """``hybridtrain ARGS`` sent ``sig`` as soon as ``ready()``; (the process, its stderr)."""
    proc = subprocess.Popen(command(args), cwd=REPO, env=env_with_venv(2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"ended before the kill point: {proc.communicate()}"
    proc.send_signal(sig)
    return proc, proc.communicate(timeout=60)[1]


def assert_stopped(proc: subprocess.Popen, stderr: str, sig: int, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.startswith("hybridtrain:")]
    assert proc.returncode == 128 + sig and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith(f"hybridtrain: stopped by {signal.Signals(sig).name}: "), stderr
    assert all(n in lines[0] for n in needles), lines[0]
    assert left_behind() == []


def ranks_on(host: str):
    """ready(): a process other than sshd runs on ``host`` (a rank of a row, its torchrun)."""
    def ready() -> bool:
        pids = cluster.sh("ip", "netns", "pids", cluster.namespace(host), check=False).stdout.split()
        return any(not open(f"/proc/{p}/cmdline").read().startswith("sshd") for p in pids if os.path.exists(
            f"/proc/{p}/cmdline"))
    return ready


@needs_cluster
@pytest.mark.parametrize("sig,point", [(signal.SIGTERM, "namespaces"), (signal.SIGINT, "sshd")])
def test_cluster_up_stopped_while_it_builds_removes_what_it_made(sig, point):
    """Killed once the first namespace exists, or once the first sshd runs (60 hosts take ~2 s to build)."""
    cluster.down()
    marker = "/run/netns/htc-h0" if point == "namespaces" else os.path.join(cluster.STATE_DIR, "h0.pid")
    proc, stderr = kill_when(["cluster", "up", "--hosts", "60"], lambda: os.path.exists(marker), sig)
    assert_stopped(proc, stderr, sig, "the cluster is removed")


@needs_cluster
def test_cluster_exec_stopped_ends_its_command_and_exec_without_a_command_says_so():
    assert hybridtrain("cluster", "up", "--hosts", "2").returncode == 0
    try:
        assert_one_error_line(hybridtrain("cluster", "exec", "h1"), "cluster exec h1 was given no command")
        assert_one_error_line(hybridtrain("cluster", "exec", "h9", "--", "true"), "h9 is not a host", "h0, h1")
        proc, stderr = kill_when(["cluster", "exec", "h1", "--", "sleep", "4242"], ranks_on("h1"), signal.SIGTERM)
        lines = [line for line in stderr.splitlines() if line.startswith("hybridtrain:")]
        assert proc.returncode == 143 and lines == ["hybridtrain: stopped by SIGTERM: the command on h1 ended"], stderr
        assert not ranks_on("h1")()
        assert cluster.namespaces() != []  # exec leaves the cluster up
    finally:
        cluster.down()


SCALE = ["scale", "--config", "configs/demo.yaml", "--set", "train.batch_size=2", "--cluster", "2", "--engine",
         "torch", "--compression", "none", "--steps", "1", "--warmup", "0"]


@needs_cluster
def test_scale_cluster_stopped_before_the_cluster_and_while_its_ranks_run_leaves_nothing(tmp_path):
    """Ctrl-C during the one-rank run on this machine (torchrun and its rank end); SIGTERM while the rows' ranks run
    on the hosts (the ranks, the sshds and the namespaces go)."""
    def local_rank() -> bool:
        return bool(subprocess.run(["pgrep", "-f", "benchmarks.scaling"], capture_output=True).stdout)
    proc, stderr = kill_when([*SCALE, "--out", str(tmp_path / "a")], local_rank, signal.SIGINT)
    assert_stopped(proc, stderr, signal.SIGINT, "ranks ended")
    proc, stderr = kill_when([*SCALE, "--out", str(tmp_path / "b")], ranks_on("h1"), signal.SIGTERM)
    assert_stopped(proc, stderr, signal.SIGTERM, "ranks ended", "cluster is removed")


@needs_cluster
def test_a_command_that_would_take_the_cluster_in_use_is_one_line_naming_its_holder(tmp_path):
    """The cluster in a box is one per machine (CI's lesson: one test file's `cluster down` took the hosts of the
    other's scale run). While `cluster exec` runs there, `cluster down` and `scale --cluster` are refused in one line
    naming it, and nothing is removed; a second `cluster exec` runs beside it (one torchrun per host); once it ends,
    `cluster down` works."""
    assert hybridtrain("cluster", "up", "--hosts", "2").returncode == 0
    holder = subprocess.Popen([*TOOLS, "cluster", "exec", "h1", "--", "sleep", "120"], stdin=subprocess.DEVNULL,
                              env=env_with_venv(1), cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while "cluster exec h1" not in (open(cluster.LOCK_PATH).read() if os.path.exists(cluster.LOCK_PATH) else ""):
            assert time.monotonic() < deadline and holder.poll() is None, "cluster exec never held the cluster"
            time.sleep(0.2)
        for args in (["cluster", "down"], [*SCALE, "--out", str(tmp_path / "out")]):
            assert_one_error_line(hybridtrain(*args), f"in use by cluster exec h1 (pid {holder.pid})",
                                  "rerun it when that has ended")
            assert sorted(cluster.namespaces()) == ["htc-h0", "htc-h1", "htc-switch"]
        assert hybridtrain("cluster", "exec", "h0", "--", "true").returncode == 0
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    assert hybridtrain("cluster", "down").returncode == 0 and cluster.namespaces() == []


# ----------------------------------------------------------------------------- 4. engine plugins; no trace of a refusal

PLUGINS = {
    "raises_on_import": ("raise RuntimeError('no licence server')\n", "raised RuntimeError: no licence server at "),
    "imports_a_missing_library": ("import fancy_collectives_lib\n", "No module named 'fancy_collectives_lib'"),
    "bad_syntax": ("def init(:\n", "raised SyntaxError"),
    "registers_a_dict": ("ENGINE_SPEC = {'name': 'mine'}\n", "its ENGINE_SPEC is a dict, not an EngineSpec"),
    "registers_nothing": ("NAME = 'mine'\n", "it defines no ENGINE_SPEC"),
}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    """Two classes of four 16-px images in train and val."""
    root = tmp_path_factory.mktemp("data")
    for split in ("train", "val"):
        for cls in ("a", "b"):
            os.makedirs(root / split / cls)
            for i in range(4):
                Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(root / split / cls / f"{i}.jpg")
    return str(root)


def recipe(tmp_path, data: str, run_dir: str) -> str:
    cfg = tiny_config(data, run_dir, data={"crop_size": 16, "val_resize": 16}, train={"batch_size": 4})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_broken_engine_plugin_is_one_line_naming_the_module_and_what_is_wrong(tmp_path, tiny_data):
    """Each plugin module is written into tmp_path, put on PYTHONPATH and named by HYBRIDTRAIN_ENGINE_PLUGINS, as
    engines.py finds plugins; the train refuses before its run_dir exists."""
    run_dir = tmp_path / "runs" / "r"
    config = recipe(tmp_path, tiny_data, str(run_dir))
    for name, (code, what) in [*PLUGINS.items(), ("not_on_the_path", ("", "is not found on this python's path"))]:
        if code:
            (tmp_path / f"{name}.py").write_text(code)
        env = {**env_with_venv(1), "HYBRIDTRAIN_ENGINE_PLUGINS": name, "PYTHONPATH": str(tmp_path)}
        line = assert_one_error_line(hybridtrain("train", "--config", config, env=env),
                                     f"HYBRIDTRAIN_ENGINE_PLUGINS names {name}, which is not an engine module", what)
        assert "a bug in hybridtrain" not in line
    assert not os.path.exists(tmp_path / "runs")


def test_a_run_refused_before_its_first_epoch_ends_leaves_no_folder(tmp_path, tiny_data):
    """An unreadable image stops the run in its first steps, after the run_dir was claimed: the folders the claim
    made (runs/deep/r) go; a run_dir that existed stays."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    (data / "train" / "a" / "broken.jpg").write_bytes(b"not a jpeg")
    config = recipe(tmp_path, str(data), str(tmp_path / "runs" / "deep" / "r"))
    assert_one_error_line(hybridtrain("train", "--config", config), "broken.jpg")
    assert os.listdir(tmp_path) and not os.path.exists(tmp_path / "runs")


# ----------------------------------------------------------------------------- 5. true causes and numbers

def test_a_section_mapping_in_set_is_judged_key_by_key_against_where_each_value_came_from(tmp_path):
    """A moved key given inside a section mapping overrides the recipe's value under its new name (it used to be
    called 'both given by --set'), and an old and a new name given both by --set are refused, mapping or not (the
    mapping used to win or lose silently)."""
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text("distributed: {gloo_timeout_s: 30}\n")
    cfg = load_config(str(recipe_path), ["horovod={gloo_timeout_s: 60}", "train={batch_size: 8}"])
    assert (cfg.distributed.gloo_timeout_s, cfg.train.batch_size) == (60, 8)
    for sets in (["distributed={gloo_timeout_s: 60}", "horovod.gloo_timeout_s=90"],
                 ["horovod={gloo_timeout_s: 60}", "distributed.gloo_timeout_s=90"]):
        args = [a for s in sets for a in ("--set", s)]
        assert_one_error_line(hybridtrain("train", "--config", str(recipe_path), *args),
                              "horovod.gloo_timeout_s (the old name) and distributed.gloo_timeout_s are both given "
                              "by --set")



def test_a_cpu_compile_without_setuptools_is_one_line_naming_the_package(tmp_path, tiny_data):
    """Inductor builds a CPU model's kernels through torch.utils.cpp_extension, which imports setuptools; a Python
    3.12+ venv has none. That used to end in the first step as 'unexpected InductorError ... a bug'."""
    from venvs import linked_venv
    python = linked_venv(str(tmp_path / "venv"), ["setuptools", "setuptools-*", "_distutils_hack",
                                                  "distutils-precedence.pth", "pkg_resources"])
    gone = subprocess.run([python, "-c", "import setuptools"], capture_output=True, text=True, cwd=tmp_path)
    assert "No module named 'setuptools'" in gone.stderr
    config = recipe(tmp_path, tiny_data, str(tmp_path / "runs" / "r"))
    proc = subprocess.run([python, "-m", "hybridtrain", "train", "--config", config, "--set", "train.device=cpu",
                           "--set", "train.compile=true"], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=env_with_venv(1), stdin=subprocess.DEVNULL)
    assert_one_error_line(proc, "train.compile=true needs setuptools", "pip install setuptools",
                          "set train.compile=false")

@needs_cluster
@pytest.mark.parametrize("rate", ["0.001kbit", "1kbit", "2000gbit"])
def test_a_link_rate_tc_cannot_do_is_refused_before_tc_runs(rate):
    """Below 8 bit/s tc prints its usage; below 2 kbit/s and above 1000 gbit/s tbf silently keeps another burst or
    queue than asked (32-bit fields)."""
    for args in (["cluster", "up", "--link", rate], [*SCALE, "--link", rate, "--out", "/tmp/unused"]):
        proc = hybridtrain(*args)
        assert_one_error_line(proc, f"--link {rate}", "from 2kbit to 1000gbit")
        assert "Usage" not in proc.stderr and cluster.namespaces() == []


@needs_root
def test_a_read_only_file_system_and_a_dangling_link_are_called_that(tmp_path, tiny_data):
    """As root, in a mount namespace of its own: a read-only tmpfs is not 'permissions'; a run_dir or --out through
    a link to a missing folder names the link."""
    ro, dangling = tmp_path / "ro", tmp_path / "gone"
    ro.mkdir()
    dangling.symlink_to(tmp_path / "unmounted")
    config = recipe(tmp_path, tiny_data, str(ro / "run"))
    for args, option in (([HYBRIDTRAIN, "train", "--config", config], f"run_dir {ro}/run"),
                         ([*BENCHMARKS, "scale", "--np", "1", "--out", str(ro / "out")], f"--out {ro}/out"),
                         ([*BENCHMARKS, "scale", "--np", "1", "--json", str(ro / "rows.json")], "--json")):
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs -o ro,size=1m tmpfs "$0" && exec "$@"', str(ro), *args],
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=env_with_venv(1),
                              stdin=subprocess.DEVNULL)
        line = assert_one_error_line(proc, option, "read-only file system")
        assert "permission" not in line, line
    for args in (["scale", "--np", "1", "--out", str(dangling / "x")], ["scale", "--np", "1", "--out", str(dangling)],
                 ["train", "--config", config, "--set", f"run_dir={dangling}/run"]):
        assert_one_error_line(hybridtrain(*args), f"{dangling} is a symbolic link to {tmp_path / 'unmounted'}",
                              "fix or remove the link")


# ----------------------------------------------------------------------------- 7. records judged before they are shown

@pytest.mark.parametrize("pairs,what", [
    ([{"from": "h0", "to": "h0", "bits_per_s": 1e9}], "a transfer from h0 to itself"),
    ([{"from": "h0", "to": "h1", "bits_per_s": 0}], "at 0 bit/s, which is no measured rate"),
    ([{"from": "h0", "to": "h1", "bits_per_s": 1e9}, {"from": "h1", "to": "h2", "bits_per_s": float("inf")},
      {"from": "h0", "to": "h2", "bits_per_s": 1e9}], "at inf bit/s"),
    ([{"from": "h0", "to": "h1", "bits_per_s": 1e9}, {"from": "h1", "to": "h2", "bits_per_s": 1e-300},
      {"from": "h0", "to": "h2", "bits_per_s": 1e9}], "at 1e-300 bit/s"),
])
def test_a_link_probe_record_that_is_no_measurement_is_one_line_naming_the_file(tmp_path, pairs, what):
    run_dir = write_run(tmp_path / "run", [0.5, 0.7], [0.8, 0.9])
    with open(os.path.join(run_dir, "link_probe.json"), "w") as fh:
        json.dump({"hosts": ["h0", "h1"], "pairs": pairs}, fh)  # inf as JSON's Infinity, as json.dump writes it
    proc = hybridtrain("report", run_dir)
    line = assert_one_error_line(proc, f"{run_dir}/link_probe.json is not a link probe", what)
    assert "slower" not in proc.stdout + proc.stderr, line


def every_option(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from every_option(sub, f"{name} {command}")
        else:
            yield name, action


def test_a_bounded_option_names_its_range_not_a_list_of_its_values():
    """No option lists more than a handful of choices (argparse's error prints them all: choices=range(1, 1025)
    printed 1024 numbers); the link probe's --megabytes names its range."""
    from benchmarks.cli import build_parser as benchmarks_parser
    from hybridtrain.cli import build_parser
    from tools.cli import build_parser as tools_parser
    from tools.cluster.link_probe import build_parser as link_probe_parser
    long = [(name, action.option_strings) for parser, prog in ((build_parser(), "hybridtrain"),
                                                               (benchmarks_parser(), "benchmarks"),
                                                               (tools_parser(), "tools"),
                                                               (link_probe_parser(), "link_probe"))
            for name, action in every_option(parser, prog) if action.choices is not None and len(action.choices) > 10]
    assert long == []
    proc = subprocess.run([os.path.join(os.path.dirname(HYBRIDTRAIN), "python"), "-m",
                           "tools.cluster.link_probe", "--hosts", "h0,h1", "--out", "/tmp/unused",
                           "--megabytes", "0"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    line = assert_one_error_line(proc, "--megabytes must be in [1, 1024]")
    assert len(proc.stderr) < 300 and len(error_lines(proc.stderr)) == 1, line


def test_bench_and_experiment_stopped_end_the_ranks_they_launched(tmp_path, tiny_data):
    """The other commands that start ranks: bench --engine (the whole step under torchrun) and experiment (each row
    a launched run) end them on SIGTERM / Ctrl-C with one line and 128 + the signal."""
    config = recipe(tmp_path, tiny_data, str(tmp_path / "run"))

    def ranks() -> list[str]:  # this test's ranks only: the recipe's path is on their command line
        found = subprocess.run(["pgrep", "-af", config], capture_output=True, text=True).stdout.splitlines()
        return [line for line in found if "benchmarks.scaling" in line or " train " in line]

    for args, sig in ((["bench", "--config", config, "--engine", "torch", "--steps", "50", "--warmup", "1"],
                       signal.SIGTERM),
                      (["experiment", "init", "--config", config, "--out", str(tmp_path / "exp"), "--ranks", "1",
                        "--engine", "torch"], signal.SIGINT)):
        proc, stderr = kill_when(args, lambda: bool(ranks()), sig)
        lines = [line for line in stderr.splitlines() if line.startswith("hybridtrain:")]
        assert proc.returncode == 128 + sig and "Traceback" not in stderr, stderr
        assert lines and lines[-1].startswith(f"hybridtrain: stopped by {signal.Signals(sig).name}: its "), stderr
        assert ranks() == [], ranks()


@pytest.mark.parametrize("command, sets, needle", [
    (["bench", "--steps", "1"], ["horovod.autotune=true", "horovod.autotune_log={missing}/autotune.csv"], "horovod.autotune_log="),
    (["scale", "--np", "1", "--out", "{tmp}/scale"], ["horovod.autotune=true", "horovod.autotune_log={missing}/autotune.csv"],
     "horovod.autotune_log="),
    (["experiment", "optimizers", "--out", "{tmp}/exp"], ["data.path={missing}"], "data directory not found"),
    (["plot-schedule", "--out", "{tmp}/s.png"], ["run_dir=runs/a\tb"], "holds a control character"),
])
def test_each_command_checks_the_path_keys_it_uses_before_any_work(tmp_path, command, sets, needle):
    """config.PATH_USES names the path keys each command uses; bench, scale, experiment and plot-schedule now check
    them as train does, before any rank is launched (they checked none: a missing autotune folder or dataset was
    found by the launched ranks)."""
    fill = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    args = [a.format(**fill) for a in command] + ["--config", os.path.join(REPO, "configs", "demo.yaml")]
    for s in sets:
        args += ["--set", s.format(**fill)]
    started = time.monotonic()
    assert_one_error_line(hybridtrain(*args), needle)
    assert time.monotonic() - started < 60 and not os.path.exists(tmp_path / "exp" / "optimizers")
