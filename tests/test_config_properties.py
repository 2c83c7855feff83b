"""Values validated to the bit: every config key and every command-line option, fed any value, either
gives a valid run or one line ``hybridtrain: error: ...`` (exit 2), never a traceback, a hang or a silent wrong run.

Property-based (Hypothesis, derandomized so CI is reproducible) over every key of the config dataclasses and every
option of every subcommand, plus hand-picked bad values through a real ``hybridtrain`` process. No mocks.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from conftest import BENCHMARKS, HYBRIDTRAIN, REPO, assert_one_error_line, run, tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.cli import build_parser as benchmarks_parser
from hybridtrain.cli import build_parser
from hybridtrain.config import PATH_USES, Config, check_paths, config_from_dict, load_config
from hybridtrain.errors import UserError
from tools.cli import build_parser as tools_parser

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def config_fields(cls=Config, prefix=""):
    """(dotted key, dataclass field) for every leaf key, walking the sections."""
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            yield from config_fields(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


FIELDS = dict(config_fields())
SECTIONS = sorted({key.split(".")[0] for key in FIELDS if "." in key})


def assert_one_line_user_error(exc: UserError) -> None:
    message = str(exc)
    assert message and len(message.splitlines()) == 1, repr(message)
    assert len(message) < 1000, message


# ----------------------------------------------------------------------------- every key, every kind of value

def values():
    """None, bools, ints (huge and negative), floats (NaN, +-inf, -0.0), strings ('' '~', paths), lists, dicts."""
    ints = st.one_of(st.integers(), st.sampled_from([0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**63, -2**63, 2**64,
                                                     10**400, 65536, 65537, 1_000_001]))
    floats = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, 5e-324,
                                                     2.0**24, 2.0**24 + 2]))
    texts = st.one_of(st.text(max_size=12), st.sampled_from(["", "~", "~/x", "~nobody/x", "/", ".", "..", "a\nb",
                                                             "1e-4", "fp16", "resnet50", "runs/x", "/dev/null"]))
    scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(texts, inner, max_size=3)), max_leaves=8)


def dumped(value) -> str:
    """The value as a --set writes it: YAML on one line."""
    return yaml.safe_dump(value, default_flow_style=True, width=2**31).rstrip("\n").removesuffix("\n...")


def load_or_error(path, overrides):
    """load_config's result, or its UserError checked to be one line; any other exception fails the test."""
    try:
        cfg = load_config(path, overrides)
    except UserError as exc:
        assert_one_line_user_error(exc)
        return None
    assert isinstance(cfg, Config)
    return cfg


def assert_validated(cfg: Config) -> None:
    """A returned config holds finite numbers inside each key's declared range."""
    for key, f in FIELDS.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        numbers = value if isinstance(value, list) else [value]
        for v in numbers:
            if isinstance(v, float):
                assert math.isfinite(v), (key, v)
        lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
        if lo is not None:
            assert value > lo if f.metadata["lo_open"] else value >= lo, (key, value)
        if hi is not None:
            assert value < hi if f.metadata["hi_open"] else value <= hi, (key, value)


@settings(max_examples=400, **SETTINGS)
@given(key=st.sampled_from(sorted(FIELDS) + SECTIONS), value=values())
def test_any_value_of_any_key_through_set_is_a_config_or_one_error_line(key, value):
    cfg = load_or_error(None, [f"{key}={dumped(value)}"])
    if cfg is not None:
        assert_validated(cfg)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("props")
    (root / "a-file").write_text("x")
    (root / "lists").mkdir()
    for split in ("train", "val"):
        (root / "lists" / f"{split}.txt").write_text("")
    return root


@settings(max_examples=250, **SETTINGS)
@given(key=st.sampled_from(sorted(FIELDS) + SECTIONS), value=values(), data=st.data())
def test_any_value_of_any_key_in_a_yaml_file_is_a_config_or_one_error_line(scratch, key, value, data):
    tree: dict = {}
    node = tree
    *sections, leaf = key.split(".")
    for part in sections:
        node = node.setdefault(part, {})
    node[leaf] = value
    path = scratch / f"recipe-{data.draw(st.integers(0, 3))}.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_or_error(str(path), [])
    if cfg is not None:
        assert_validated(cfg)


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_path_keys_are_checked_for_their_kind_in_one_line(scratch, data):
    paths = st.one_of(st.sampled_from([str(scratch), str(scratch / "a-file"), str(scratch / "missing"),
                                       str(scratch / "missing" / "deeper"), str(scratch / "lists"), "~", "~/x",
                                       "", " ", "/", "/proc/version", "rel/dir", str(scratch / "a-file" / "sub")]),
                      st.text(max_size=8))
    sets = [f"data.path={dumped(data.draw(paths))}", f"run_dir={dumped(data.draw(paths))}",
            f"data.backend={data.draw(st.sampled_from(['torchvision', 'synthetic']))}"]
    if data.draw(st.booleans()):
        sets.append(f"data.file_lists={dumped(data.draw(paths))}")
    if data.draw(st.booleans()):
        sets += ["horovod.autotune=true", f"horovod.autotune_log={dumped(data.draw(paths))}"]
    cfg = load_or_error(None, sets)
    if cfg is None:
        return
    for command in PATH_USES:
        try:
            check_paths(cfg, command)
        except UserError as exc:
            assert_one_line_user_error(exc)


def test_every_count_and_size_has_an_upper_bound():
    unbounded = [key for key, f in FIELDS.items() if f.type in ("int", int) and f.metadata.get("hi") is None]
    assert unbounded == []


# ----------------------------------------------------------------------------- the command line

# the package's command and the checkout's tools beside it, whose parsers share its option types
PARSERS = {"hybridtrain": build_parser, "benchmarks": benchmarks_parser, "tools": tools_parser}


def subcommands(parser, prefix):
    """(argv prefix, subparser) for every leaf subcommand, the program first, e.g. (('hybridtrain', 'prepare-data',
    'digits'), parser)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, child in subs[0].choices.items():
        yield from subcommands(child, prefix + (name,))


COMMANDS = {cmd: parser for prog, build in PARSERS.items() for cmd, parser in subcommands(build(), (prog,))}
NUMERIC = (int, float)


def required_argv(parser) -> list[str]:
    """Valid values for the positionals and required options, so that a good option value can parse."""
    argv = []
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            argv.append(action.choices[0] if action.choices else "x")
        elif action.required:
            argv += [action.option_strings[0], list(action.choices)[0] if action.choices else "x"]
    return argv


def options(parser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_numeric_option_declares_its_bounds():
    loose = [f"{' '.join(cmd)} {a.option_strings[0]}" for cmd, parser in COMMANDS.items() for a in options(parser)
             if a.type in NUMERIC and not a.choices]
    assert loose == []


def option_values():
    return st.one_of(st.text(max_size=10), st.integers().map(str), st.floats().map(repr),
                     st.sampled_from(["0", "-1", "1", "nan", "inf", "-inf", "1e999", "9" * 5000, "", " ", "1,2",
                                      "0,1", "1,,2", "65536", "65537", "4096", "0.5", "1.0", "2", "\n", "a\nb"]))


@settings(max_examples=500, **SETTINGS)
@given(command=st.sampled_from(sorted(COMMANDS)), data=st.data())
def test_any_option_value_parses_within_bounds_or_is_one_error_line(command, data):
    parser = COMMANDS[command]
    argv = list(command[1:]) + required_argv(parser)
    chosen = data.draw(st.lists(st.sampled_from(options(parser)), min_size=1, max_size=3))
    for action in chosen:
        if action.nargs == 0:
            argv.append(action.option_strings[0])
            continue
        value = str(data.draw(st.sampled_from(list(action.choices)))) if action.choices and data.draw(
            st.booleans()) else data.draw(option_values())
        argv += [f"{action.option_strings[0]}={value}"] if data.draw(st.booleans()) else [action.option_strings[0],
                                                                                         value]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = PARSERS[command[0]]().parse_args(argv)
    except SystemExit as exc:
        lines = stderr.getvalue().splitlines()
        assert exc.code == 2 and len(lines) == 1 and lines[0].startswith("hybridtrain: error: "), (argv, lines)
        return
    for action in options(parser):
        bounds = getattr(action.type, "bounds", None)
        value = getattr(args, action.dest)
        if bounds is None or value is None:
            continue
        lo, hi, lo_open, hi_open = bounds
        for v in value if isinstance(value, list) else [value]:
            for n in ([int(x) for x in v.split(",") if x.strip()] if isinstance(v, str) else [v]):
                assert math.isfinite(n) and (n > lo if lo_open else n >= lo) and (n < hi if hi_open else n <= hi), \
                    (argv, action.dest, n)


# ----------------------------------------------------------------------------- hand-picked bad values, in-process

def test_duplicate_keys_at_any_depth_name_the_key_and_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("optim:\n  name: goyal\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(UserError, match=r"line 4: key 'lr' appears twice in one section \(first at line 3\)"):
        load_config(str(path))
    path.write_text("train:\n  <<: {epochs: 30, batch_size: 8}\n  epochs: 40\n")  # a merge key still yields
    cfg = load_config(str(path))
    assert (cfg.train.epochs, cfg.train.batch_size) == (40, 8)
    with pytest.raises(UserError, match="appears twice"):
        load_config(None, ["train={epochs: 1, epochs: 2}"])


@pytest.mark.parametrize("text", ["", "# only a comment\n\n# and another\n", "---\n"])
def test_an_empty_config_file_is_refused_but_no_file_means_the_defaults(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match="is empty"):
        load_config(str(path))
    assert load_config(None).train.epochs == 90  # bench without --config


def test_numbers_are_finite_everywhere_and_lists_too():
    for override in ["optim.lr=.nan", "optim.lr=.inf", "optim.weight_decay=-.inf", "precision.loss_scale=.inf",
                     "optim.betas=[0.9, .nan]", "optim.milestones=[0.5, .inf]", "optim.lr=1" + "0" * 400,
                     "precision.loss_scale=16777218.0", "seed=4294967296", "train.batch_size=65537"]:
        with pytest.raises(UserError) as err:
            load_config(None, [override])
        assert_one_line_user_error(err.value)
        assert override.split("=")[0].split("[")[0] in str(err.value)


def test_path_checks_skip_data_for_the_synthetic_backend(tmp_path):
    cfg = load_config(None, ["data.backend=synthetic", "data.path=~/nowhere", f"run_dir={tmp_path / 'r'}"])
    check_paths(cfg, "train")
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "train.txt").write_text("")
    cfg = load_config(None, [f"data.path={tmp_path}", f"data.file_lists={tmp_path / 'lists'}"])
    with pytest.raises(UserError, match="has no val.txt: run 'hybridtrain check-data"):
        check_paths(cfg, "train")
    cfg = load_config(None, ["horovod.autotune=true", f"horovod.autotune_log={tmp_path / 'no' / 'a.csv'}"])
    with pytest.raises(UserError, match="does not exist: create it"):
        check_paths(cfg, "bench")


# ----------------------------------------------------------------------------- keys that moved (horovod: -> distributed:)

# each unlike its default (and valid with the default precision)
MOVED_VALUES = {"compression": "none", "stall_warning_s": 7, "stall_shutdown_s": 70, "gloo_timeout_s": 9}


def moved_warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "moved to" in line]


@pytest.mark.parametrize("key", sorted(MOVED_VALUES))
def test_a_moved_key_under_its_old_name_gives_the_same_value_and_one_warning(tmp_path, capsys, monkeypatch, key):
    """A recipe, a --set and a mapping that name horovod.<key> give distributed.<key> the same value as the new
    name does, each with one warning line naming the new key; the horovod section no longer holds it."""
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    value = MOVED_VALUES[key]
    old_recipe, new_recipe = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old_recipe.write_text(yaml.safe_dump({"horovod": {key: value, "cycle_time_ms": 2.0}}))
    new_recipe.write_text(yaml.safe_dump({"distributed": {key: value}}))
    expected = load_config(str(new_recipe)).distributed
    assert getattr(expected, key) == value and capsys.readouterr().err == ""
    for load in (lambda: load_config(str(old_recipe)), lambda: load_config(None, [f"horovod.{key}={value}"]),
                 lambda: config_from_dict({"horovod": {key: value}})):
        cfg = load()
        assert cfg.distributed == expected and not hasattr(cfg.horovod, key)
        assert moved_warnings(capsys.readouterr().err) == [
            f"hybridtrain: warning: config: horovod.{key} moved to distributed.{key}; it still works, rename it"]
    assert load_config(str(old_recipe)).horovod.cycle_time_ms == 2.0  # the section's other keys stay
    capsys.readouterr()
    monkeypatch.setenv("HOROVOD_RANK", "1")  # one line per job: rank 0's
    assert getattr(load_config(str(old_recipe)).distributed, key) == value
    assert moved_warnings(capsys.readouterr().err) == []


def test_a_set_of_either_name_overrides_the_recipes_other_name(tmp_path, capsys):
    new_recipe, old_recipe = tmp_path / "new.yaml", tmp_path / "old.yaml"
    new_recipe.write_text(yaml.safe_dump({"distributed": {"stall_shutdown_s": 300}}))
    old_recipe.write_text(yaml.safe_dump({"horovod": {"stall_shutdown_s": 300}}))
    cfg = load_config(str(new_recipe), ["horovod.stall_shutdown_s=120"])
    assert cfg.distributed.stall_shutdown_s == 120 and len(moved_warnings(capsys.readouterr().err)) == 1
    cfg = load_config(str(old_recipe), ["distributed.stall_shutdown_s=120"])
    assert cfg.distributed.stall_shutdown_s == 120 and len(moved_warnings(capsys.readouterr().err)) == 1


@pytest.mark.parametrize("key", ["gloo_timeout_s", "compression"])
@pytest.mark.parametrize("how", ["recipe", "set", "set-new-first", "mapping"])
def test_both_names_of_a_moved_key_are_refused_in_one_line(tmp_path, capsys, how, key):
    value = MOVED_VALUES[key]
    both = {"horovod": {key: value}, "distributed": {key: value}}
    recipe = tmp_path / "both.yaml"
    recipe.write_text(yaml.safe_dump(both))
    sets = [f"horovod.{key}={value}", f"distributed.{key}={value}"]
    load = {"recipe": lambda: load_config(str(recipe)), "set": lambda: load_config(None, sets),
            "set-new-first": lambda: load_config(None, sets[::-1]), "mapping": lambda: config_from_dict(both)}[how]
    with pytest.raises(UserError) as refused:
        load()
    assert_one_line_user_error(refused.value)
    assert f"horovod.{key} (the old name) and distributed.{key} are both given" in str(refused.value)
    assert f"keep distributed.{key} only" in str(refused.value)
    assert capsys.readouterr().err == ""  # the refusal is the one line: no warning before it


def test_a_checkpoint_written_before_the_compression_moved_keeps_its_fingerprint(capsys):
    """A resume compares the checkpoint's config fingerprint with the config's. One written with
    horovod.compression (where the key first stood), its fingerprint as that code took it (the sha256 of every
    section but distributed), still matches once the key has moved; the compression still counts (it changes the
    math), the engine's limits still do not."""
    old_layout = Config().to_dict()
    del old_layout["distributed"]["compression"]
    old_layout["horovod"]["compression"] = "none"
    recipe = {section: keys for section, keys in old_layout.items() if section not in ("distributed", "profile", "sinks")}
    written = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    moved = config_from_dict(old_layout)
    assert moved.distributed.compression == "none" and len(moved_warnings(capsys.readouterr().err)) == 1
    assert moved.fingerprint() == written
    assert load_config(None, ["distributed.compression=none"]).fingerprint() == written
    assert load_config(None, ["distributed.compression=auto"]).fingerprint() != written
    assert load_config(None, ["distributed.compression=none", "distributed.stall_warning_s=7",
                              "distributed.engine=torch"]).fingerprint() == written


def test_the_compression_under_its_old_name_reaches_the_trainer(tmp_path, capsys):
    """horovod.compression=none where auto would send FP16 (the loss is scaled): the trainer that build_trainer
    makes, in a job of this process alone on the torch engine, sends the gradients as they are."""
    import torch

    from hybridtrain.config import gradient_compression
    from hybridtrain.distributed import collectives as distributed
    from hybridtrain.engine.trainer import build_trainer
    cfg = load_config(None, ["horovod.compression=none", "precision.loss_scaling=dynamic", "data.backend=synthetic",
                             "data.crop_size=32", "data.synthetic_images=16", "model.arch=resnet18",
                             "model.num_classes=4", "train.batch_size=8", "train.progress=false",
                             f"run_dir={tmp_path / 'run'}"])
    assert len(moved_warnings(capsys.readouterr().err)) == 1
    assert gradient_compression("auto", cfg.precision) == "fp16"  # what the default would send
    topo = distributed.init(torch.get_num_threads(), cfg, device="cpu", engine="torch")
    try:
        trainer = build_trainer(cfg, topo)
    finally:
        distributed.shutdown()
    assert trainer.compression == "none"


# ----------------------------------------------------------------------------- hand-picked bad values, real processes

@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> dict:
    """Each hand-picked bad value through a real ``hybridtrain`` process; started three at a time (each one imports
    torch), so the file stays quick. name -> CompletedProcess."""
    root = tmp_path_factory.mktemp("examples")
    (root / "a-file").write_text("x")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_config(str(root), str(root / "run"))))
    (root / "dup.yaml").write_text(f"run_dir: {root / 'run'}\ntrain:\n  epochs: 1\noptim:\n  name: goyal\n"
                                   f"train:\n  epochs: 90\n")
    (root / "empty.yaml").write_text("")  # comments only: the in-process test above
    train = [HYBRIDTRAIN, "train", "--config"]
    argvs = {
        "lr-nan": [*train, str(recipe), "--set", "optim.lr=.nan"],
        "lr-inf": [*train, str(recipe), "--set", "optim.lr=.inf"],
        "duplicate-train": [*train, str(root / "dup.yaml")],
        "empty": [*train, str(root / "empty.yaml")],
        "bench-batch-0": [*BENCHMARKS, "bench", "--batch-size", "0"],
        "data-path-file": [*train, str(recipe), "--set", f"data.path={root / 'a-file'}"],
        "data-path-tilde": [*train, str(recipe), "--set", "data.path=~/x"],
        "run-dir-file": [*train, str(recipe), "--set", f"run_dir={root / 'a-file'}"],
        "moved-key-both": [*train, str(recipe), "--set", "horovod.stall_shutdown_s=100", "--set",
                           "distributed.stall_shutdown_s=100"],
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        started = {name: pool.submit(run, argv, 120) for name, argv in argvs.items()}
    return {name: future.result() for name, future in started.items()}


@pytest.mark.parametrize("example, needles", [
    ("lr-nan", ["optim.lr must be a finite number", "got nan"]),
    ("lr-inf", ["optim.lr must be a finite number", "got inf"]),
])
def test_nan_and_inf_learning_rates_are_one_line(examples, example, needles):
    assert examples[example].returncode == 2
    assert_one_error_line(examples[example], *needles)


def test_a_duplicated_train_section_is_one_line(examples):
    assert examples["duplicate-train"].returncode == 2
    assert_one_error_line(examples["duplicate-train"], "line 6: key 'train' appears twice", "first at line 2",
                          "merge them")


def test_an_empty_config_file_is_one_line(examples):
    assert examples["empty"].returncode == 2
    assert_one_error_line(examples["empty"], "is empty", "configs/demo.yaml")


def test_both_names_of_a_moved_key_are_one_line_from_the_command(examples):
    assert examples["moved-key-both"].returncode == 2
    assert_one_error_line(examples["moved-key-both"], "horovod.stall_shutdown_s (the old name)",
                          "keep distributed.stall_shutdown_s only")


def test_bench_batch_size_zero_is_one_line(examples):
    proc = examples["bench-batch-0"]
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["hybridtrain: error: --batch-size must be in [1, 65536], got 0: see "
                                        "python -m benchmarks bench --help"]


@pytest.mark.parametrize("example, needles", [
    ("data-path-file", ["is a file, not a folder", "data.path"]),
    ("data-path-tilde", ["starts with '~'", "without ~", "$HOME"]),
    ("run-dir-file", ["run_dir", "is a file, not a folder"]),
])
def test_path_keys_of_the_wrong_kind_are_one_line(examples, example, needles):
    assert examples[example].returncode == 2
    assert_one_error_line(examples[example], *needles)


def test_the_robustness_docs_section_names_tests_that_exist():
    with open(os.path.join(REPO, "docs", "robustness.md")) as fh:
        section = fh.read().split("## Values validated to the bit", 1)[1].split("\n## ", 1)[0]
    with open(__file__) as fh:
        here = fh.read()
    named = re.findall(r"`tests/test_config_properties\.py::(\w+)`", section)
    assert len(named) >= 10
    for name in named:
        assert f"def {name}(" in here, name
