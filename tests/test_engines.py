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
from conftest import TORCHRUN, digits_subset, env_with_venv, read_metrics, tiny_config

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


def test_the_configs_engine_choices_are_the_registry_and_the_clis():
    """config imports no package module, so it lists the names itself; they must be the registry's."""
    from hybridtrain.cli import build_parser
    from hybridtrain.config import Config
    section = Config().distributed
    choices = next(f for f in dataclasses.fields(section) if f.name == "engine").metadata["choices"]
    assert tuple(choices) == ("auto", *ENGINES)
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    engine_option = next(a for a in train._actions if "--engine" in a.option_strings)
    assert tuple(engine_option.choices) == tuple(choices)


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
    for call, run in (("allreduce_sum", lambda: collectives.allreduce_sum(torch.zeros(1), "x")),
                      ("size", collectives.size), ("wrap_optimizer", lambda: collectives.wrap_optimizer(None, None, None))):
        with pytest.raises(RuntimeError, match=rf"distributed\.{call}\(\) was called before distributed\.init\(\)"):
            run()


# ----------------------------------------------------------------------------- a third engine: one file, one entry

THIRD_ENGINE = '''"""A DDP-like engine outside the package: the torch engine's functions under another name."""
import dataclasses

from hybridtrain.distributed.engines import ENGINES
from hybridtrain.distributed.torch_distributed import *  # noqa: F401,F403

NAME = "ddp_copy"
ENGINE_SPEC = dataclasses.replace(ENGINES["torch"], name=NAME, module=__name__)
'''

# The config's choices are the package's engines (config imports nothing above it): a plugin engine is named
# through the API, as a program that embeds the trainer would.
DRIVER = '''import sys
from hybridtrain.config import load_config
from hybridtrain.engine.loop import run_training
cfg = load_config(sys.argv[1])
cfg.distributed.engine = "ddp_copy"
run_training(cfg)
'''


def test_a_ddp_like_engine_is_one_file_and_one_registry_entry(digits_dir, tmp_path, write_config):
    (tmp_path / "ddp_copy.py").write_text(THIRD_ENGINE)
    (tmp_path / "drive.py").write_text(DRIVER)
    data = digits_subset(digits_dir, str(tmp_path / "data"), 8, 2)  # 80 images: 3 steps of 2 x 16
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(data, run_dir, train={"epochs": 1}, optim={"name": "sgd"}))
    env = env_with_venv(2)
    env.update({PLUGINS_VAR: "ddp_copy", "PYTHONPATH": os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])})
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(tmp_path / "drive.py"), cfg],
                          capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s) of the ddp_copy engine" in proc.stdout + proc.stderr
    records = read_metrics(run_dir)
    assert [(r["epoch"], r["world_size"]) for r in records] == [(1, 2)]
    assert math.isfinite(records[0]["train_loss"])
