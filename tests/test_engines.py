"""The engine contract (``distributed.engines.Engine``) and the one registry of engines: every registered module
provides the contract, the config's choices are the registry's names, a collective before ``init`` is an error
naming it, and a DDP-like engine is one new file plus one registry entry: a copy of the torch engine, defined here
and registered through HYBRIDTRAIN_ENGINE_PLUGINS, trains under real torchrun."""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
import subprocess

import pytest
import torch
from conftest import (
    HYBRIDTRAIN,
    TORCHRUN,
    assert_one_error_line,
    command,
    digits_subset,
    env_with_venv,
    read_metrics,
    run,
    tiny_config,
)

from hybridtrain.distributed import collectives
from hybridtrain.distributed.engines import (
    ENGINES,
    PLUGINS_VAR,
    Engine,
    SteppingOptimizer,
    engine_module,
    launcher_size,
    registered,
)
from hybridtrain.distributed.launcher import launch_command, launcher_engine, resolve_engine
from hybridtrain.errors import UserError


def contract() -> dict[str, inspect.Signature]:
    """The Protocol's functions, each with its signature as a module function (no ``self``)."""
    members = {}
    for name, member in vars(Engine).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            signature = inspect.signature(member)
            members[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return members


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_registered_engine_module_provides_the_contract(name):
    module = engine_module(name)
    assert isinstance(module, Engine)
    assert module.NAME == name
    members = contract()
    assert len(members) == 15  # init, size, 9 collectives, shutdown, SyncBatchNorm, the 2 step functions
    for function, signature in members.items():
        theirs = inspect.signature(getattr(module, function))
        assert [(p.name, p.default) for p in theirs.parameters.values()] == \
               [(p.name, p.default) for p in signature.parameters.values()], function


def test_an_optimizer_of_an_engine_that_reduces_in_the_backward_keeps_the_step_contract():
    """DDP's wrap_optimizer returns the optimizer itself with no-op synchronize() and skip_synchronize(), so the loss
    scaler calls them on every engine without asking which."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert not isinstance(optimizer, SteppingOptimizer)
    wrapped = engine_module("torch").wrap_optimizer(optimizer, None, None)
    assert wrapped is optimizer and isinstance(wrapped, SteppingOptimizer)
    wrapped.synchronize()
    with wrapped.skip_synchronize():
        wrapped.step()


def test_the_registry_is_the_only_list_of_engines(tmp_path, monkeypatch):
    """The config key and --engine take what is registered, a plugin included, and refuse
    anything else in one line naming the registered engines; no module but the registry spells the names out."""
    import re

    from hybridtrain.cli import build_parser
    from hybridtrain.config import Config
    section = Config().distributed
    assert "choices" not in next(f for f in dataclasses.fields(section) if f.name == "engine").metadata
    listed = re.compile(r"[\"']horovod[\"'],\s*[\"']torch[\"']|[\"']torch[\"'],\s*[\"']horovod[\"']")
    package = os.path.dirname(os.path.dirname(os.path.abspath(collectives.__file__)))
    for root, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py") and name != "engines.py":
                assert not listed.search(open(os.path.join(root, name)).read()), os.path.join(root, name)
    (tmp_path / "ddp_copy.py").write_text(THIRD_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PLUGINS_VAR, "ddp_copy")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert build_parser().parse_args(["train", "--config", "c.yaml", "--engine", "ddp_copy"]).engine == "ddp_copy"
    from benchmarks.cli import build_parser as benchmarks_parser
    assert benchmarks_parser().parse_args(["bench", "--engine", "ddp_copy"]).engine == ["ddp_copy"]
    proc = run([HYBRIDTRAIN, "train", "--config", "c.yaml", "--engine", "tyo"], timeout=60)
    assert_one_error_line(proc, "argument --engine: 'tyo' is not a registered engine: choose auto, horovod, torch, "
                                "ddp_copy")
    with pytest.raises(UserError, match="distributed.engine=tyo is not an engine: choose auto, horovod, torch, "
                                        "ddp_copy"):
        resolve_engine("tyo", dict(os.environ))


def test_each_engines_launcher_command_and_variables_come_from_its_entry():
    assert launch_command("torch", 2, ["prog"])[-4:] == ["--standalone", "--nproc-per-node=2", "--no-python", "prog"]
    horovod = launch_command("horovod", 3, ["prog"], ("--timeline-filename", "t.json"))
    assert horovod[1:] == ["--gloo", "-np", "3", "-H", "localhost:3", "--timeline-filename", "t.json", "prog"]
    assert launcher_engine({"TORCHELASTIC_RUN_ID": "j", "OMPI_COMM_WORLD_RANK": "0"}) == "torch"  # torchrun in mpirun
    assert launcher_engine({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "PMIX_RANK": "1"}) is None  # srun's own PMI
    assert launcher_engine({"PMI_RANK": "1"}) == "horovod"  # MPICH's mpirun
    assert launcher_size({"OMPI_COMM_WORLD_SIZE": "4"}) == 4 and launcher_size({}) == 0
    with pytest.raises(UserError, match="distributed.engine=xla is not an engine: choose auto, horovod, torch"):
        resolve_engine("xla", {})


def test_a_plugin_that_is_no_engine_module_or_takes_a_taken_name_is_one_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "not_an_engine.py").write_text("X = 1\n")
    (tmp_path / "second_torch.py").write_text(
        "import dataclasses\nfrom hybridtrain.distributed.engines import ENGINES\n"
        "ENGINE_SPEC = dataclasses.replace(ENGINES['torch'])\n")
    with pytest.raises(UserError, match=f"{PLUGINS_VAR} names not_an_engine, which is not an engine module"):
        registered({PLUGINS_VAR: "not_an_engine"})
    with pytest.raises(UserError, match="registers engine 'torch', a name already taken"):
        registered({PLUGINS_VAR: "second_torch"})


def test_a_collective_before_init_is_an_error_naming_the_call(monkeypatch):
    monkeypatch.setitem(collectives._active, "engine", None)
    for call, attempt in (("allreduce_sum", lambda: collectives.allreduce_sum(torch.zeros(1), "x")),
                          ("size", collectives.size),
                          ("wrap_optimizer", lambda: collectives.wrap_optimizer(None, None, None))):
        with pytest.raises(RuntimeError, match=rf"distributed\.{call}\(\) was called before distributed\.init\(\)"):
            attempt()


# ----------------------------------------------------------------------------- a third engine: one file, one entry

THIRD_ENGINE = '''"""A DDP-like engine outside the package: the torch engine's functions under another name."""
import dataclasses

from hybridtrain.distributed.engines import ENGINES
from hybridtrain.distributed.torch_distributed import *  # noqa: F401,F403

NAME = "ddp_copy"
ENGINE_SPEC = dataclasses.replace(ENGINES["torch"], name=NAME, module=__name__)
'''



def test_a_plugin_engine_is_one_file_and_trains_through_hybridtrain_train(digits_dir, tmp_path, write_config):
    (tmp_path / "ddp_copy.py").write_text(THIRD_ENGINE)
    data = digits_subset(digits_dir, str(tmp_path / "data"), 8, 2)  # 80 images: 3 steps of 2 x 16
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(data, run_dir, train={"epochs": 1}, optim={"name": "sgd"}))
    env = env_with_venv(2)
    env.update({PLUGINS_VAR: "ddp_copy", "PYTHONPATH": os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])})
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", HYBRIDTRAIN, "train", "--config", cfg,
                           "--engine", "ddp_copy"],
                          capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s) of the ddp_copy engine" in proc.stdout + proc.stderr
    records = read_metrics(run_dir)
    assert [(r["epoch"], r["world_size"]) for r in records] == [(1, 2)]
    assert math.isfinite(records[0]["train_loss"])


# ----------------------------------------------------------------------------- a broken plugin, wherever it is named

BROKEN_PLUGINS = {  # module -> (its code, what the line says is wrong)
    "raises_at_import": ("raise RuntimeError('no licence server')\n", "its import raised RuntimeError: no licence"),
    "second_torch": ("import dataclasses\nfrom hybridtrain.distributed.engines import ENGINES\n"
                     "ENGINE_SPEC = dataclasses.replace(ENGINES['torch'])\n", "registers engine 'torch', a name "
                     "already taken: rename it"),
}
HALF_ENGINE = '''import dataclasses
from hybridtrain.distributed.engines import ENGINES
from hybridtrain.distributed.torch_distributed import init  # noqa: F401
NAME = "half"
ENGINE_SPEC = dataclasses.replace(ENGINES["torch"], name=NAME, module=__name__)
'''


def test_a_broken_plugin_is_one_line_from_engine_the_config_and_bench(small_digits, tmp_path, write_config):
    """Plugins written into tmp_path and named by HYBRIDTRAIN_ENGINE_PLUGINS, in real processes: one that raises at
    its import or takes a taken name is one line naming it and the fix whether --engine names an engine (read while
    the command line is parsed: train, bench, experiment) or the config does; one without the engine's functions is
    one line naming what it lacks when the run starts, before any of them is called."""
    for name, (code, _) in BROKEN_PLUGINS.items():
        (tmp_path / f"{name}.py").write_text(code)
    (tmp_path / "half.py").write_text(HALF_ENGINE)
    config = write_config(tiny_config(small_digits, str(tmp_path / "run")))

    def hybridtrain(plugins: str, *args: str) -> subprocess.CompletedProcess:
        env = {**env_with_venv(1), PLUGINS_VAR: plugins,
               "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        return subprocess.run(command(args), capture_output=True, text=True, timeout=300, env=env,
                              stdin=subprocess.DEVNULL)
    for name, (_, what) in BROKEN_PLUGINS.items():
        for args in (("train", "--config", config, "--engine", "torch"),
                     ("train", "--config", config, "--set", "distributed.engine=torch"),
                     ("bench", "--engine", "torch", "--steps", "1"),
                     ("experiment", "optimizers", "--config", config, "--engine", "torch")):
            line = assert_one_error_line(hybridtrain(name, *args), name, what)
            assert "a bug" not in line and ("fix the module" in line or "rename it" in line), line
    line = assert_one_error_line(hybridtrain("half", "train", "--config", config, "--engine", "half"),
                                 "the ENGINE_SPEC of engine 'half' names half, which is not an engine module: it "
                                 "lacks size, broadcast_tensors")
    assert "wrap_optimizer" in line and " init" not in line.split("lacks", 1)[1] and "a bug" not in line
    assert not os.path.exists(tmp_path / "run")
