"""Loading a config: the strict YAML reader (duplicate keys and Python tags refused, numbers as YAML 1.2 reads
them), the ``--set`` overrides, and :func:`load_config`, which builds, validates and checks the paths."""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from typing import Any

import yaml

from hybridtrain.config.coercion import build, default_of, printable, show
from hybridtrain.config.paths import check_paths, not_dangling
from hybridtrain.config.rules import validate
from hybridtrain.config.sections import OPTIMIZER_KEYS, Config, OptimConfig
from hybridtrain.errors import UserError
from hybridtrain.files import write_text_atomically
from hybridtrain.launched_by import launcher_rank


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int, first_line: int):
        super().__init__(f"key {key!r} at line {line} repeats line {first_line}")
        self.key, self.line, self.first_line = key, line, first_line


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping (at any depth), where PyYAML keeps the
    last silently: a second ``train:`` section would replace the whole first one. Merge keys (``<<``) still
    override as YAML says."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            merge_sections_deeply(node)
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: the SafeLoader itself refuses it next
                    continue
        return super().construct_mapping(node, deep)


MERGE_TAG = "tag:yaml.org,2002:merge"


def merge_sections_deeply(node: yaml.MappingNode) -> None:
    """A section given both by a merge (``<<: *base``) and here merges key by key, as nested keys do: YAML's own merge
    would let ``train: {batch_size: 32}`` replace the base's whole train section, dropping its other keys."""
    merged: dict = {}  # key -> its value node from the merges; the first merge that gives a key wins, as in YAML
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in (s for s in sources if isinstance(s, yaml.MappingNode)):
                for k, v in source.value:
                    if isinstance(k, yaml.ScalarNode) and k.tag != MERGE_TAG:
                        merged.setdefault(k.value, v)
    for i, (key_node, value_node) in enumerate(node.value):
        base = merged.get(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
        if key_node.tag != MERGE_TAG and isinstance(value_node, yaml.MappingNode) and \
                isinstance(base, yaml.MappingNode) and base is not value_node:
            merge = yaml.ScalarNode(MERGE_TAG, "<<", value_node.start_mark, value_node.start_mark)
            node.value[i] = (key_node, yaml.MappingNode(value_node.tag, [(merge, base), *value_node.value],
                                                        value_node.start_mark, value_node.end_mark,
                                                        value_node.flow_style))


# Numbers as people write them, as YAML 1.2 and every reader but PyYAML's YAML 1.1 take them:
#   6.5e4, 1e-3, 1.0e300   floats (YAML 1.1 wants a dot and a signed exponent, else text)
#   010, 0123              decimal 10 and 123 (YAML 1.1: octal 8 and 83); 0o10 is octal 8, 0x10 hex 16
#   1:30, 2024-01-02       text, as written (YAML 1.1: sexagesimal 90, a date)
YAML12_FLOAT = (r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
                r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
YAML12_INT = r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)$"
YAML11_ONLY = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")


def yaml12_int(loader, node) -> int:
    """An int as YAML 1.2 writes it: leading zeros are decimal; 0o, 0x and 0b name the base."""
    text = loader.construct_scalar(node).replace("_", "")
    base = {"0o": 8, "0x": 16, "0b": 2}.get(text[:2].lower(), 10)
    return int(text[2:] if base != 10 else text, base)


@functools.cache
def _read_numbers_as_yaml12() -> None:
    """Once, at the first load (nothing runs at import): StrictLoader's int, float and timestamp resolvers replaced
    by YAML 1.2's int and float."""
    StrictLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in YAML11_ONLY]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(YAML12_FLOAT), list("-+0123456789."))
    StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(YAML12_INT), list("-+0123456789"))
    StrictLoader.add_constructor("tag:yaml.org,2002:int", yaml12_int)


class UnsafeTag(yaml.YAMLError):
    """A ``!!python/...`` tag: it asks the reader to build (or run) Python objects."""

    def __init__(self, tag: str, line: int):
        super().__init__(f"tag {tag} at line {line}")
        self.tag, self.line = tag, line


def yaml_load(text_or_stream):
    """YAML with duplicate keys refused (:class:`StrictLoader`); :class:`UnsafeTag` for a ``!!python/...`` tag."""
    _read_numbers_as_yaml12()
    try:
        return yaml.load(text_or_stream, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.constructor.ConstructorError as exc:
        tag = re.search(r"'tag:yaml\.org,2002:(python/[^']*)'", str(exc.problem or ""))
        if tag:
            mark = exc.problem_mark
            raise UnsafeTag(f"!!{tag.group(1)}", mark.line + 1 if mark else 0) from None
        raise


UNSAFE_FIX = ("asks to build or run Python objects, which a recipe never needs, so hybridtrain refuses it as "
              "unsafe: write plain values (numbers, text, lists)")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.epochs=5`` -> (['train', 'epochs'], 5); the value is parsed as YAML (numbers as YAML 1.2 writes them).
    A ``#`` that YAML would read as the start of a comment is refused: a shell passes it only quoted, so it is part
    of the value the user means."""
    if "=" not in text:
        raise UserError(f"bad --set {show(text)}: write it as key.sub=value, e.g. --set train.epochs=5")
    key, raw = text.split("=", 1)
    try:
        value = yaml_load(raw) if raw != "" else ""
    except DuplicateKey as exc:
        raise UserError(f"bad --set {show(text)}: key {show(exc.key)} appears twice in the value: keep one") from None
    except UnsafeTag as exc:
        raise UserError(f"bad --set {show(key)}=...: the tag {show(exc.tag)} {UNSAFE_FIX}") from None
    except RecursionError:
        raise UserError(f"bad --set {show(key)}=...: the value nests too deeply: give a plain value") from None
    except (yaml.YAMLError, ValueError):  # not YAML: the text itself
        value = raw
    if raw.count("#") > _hashes(value):
        raise UserError(f"bad --set {show(text)}: YAML reads ' #' as the start of a comment, so the value would be "
                        f"{show(value)}: to keep the #, put the value in YAML quotes (--set '{key}=\"{raw}\"'), "
                        f"or leave the comment out")
    return key.strip().split("."), value


def _hashes(value) -> int:
    """How many '#' the strings of a parsed value hold (keys and nested values included)."""
    if isinstance(value, str):
        return value.count("#")
    if isinstance(value, dict):
        return sum(_hashes(k) + _hashes(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_hashes(v) for v in value)
    return 0


def _default_at(path: list[str]) -> Any:
    """The default of what a dotted key names (a section's is its dataclass), or None for an unknown key or a key
    inside a mapping."""
    default = Config()
    for part in path:
        fields = {f.name: f for f in dataclasses.fields(default)} if dataclasses.is_dataclass(default) else {}
        if part not in fields:
            return None
        default = default_of(fields[part])
    return default


def _as_written(path: list[str], value: Any, text: str) -> Any:
    """A --set value for a text key as the user typed it: ``run_dir=2024-01-02``, ``run_dir=010`` or ``run_dir=yes``
    name a folder, not a date, 8 or true."""
    raw = text.split("=", 1)[1].strip()
    plain_scalar = raw and raw[0] not in "\"'[{&*!|>"
    if isinstance(_default_at(path), str) and not isinstance(value, (str, list, dict)) and plain_scalar:
        return raw
    return value


def _leaves(path: list[str], value: Any) -> list[tuple[list[str], Any]]:
    """A mapping given for a section as the keys it sets (``--set train={batch_size: 32}`` is ``--set
    train.batch_size=32``), so that each is judged as a dotted key would be: a moved key's old name renamed and
    overriding the recipe's value, an old and a new name given both by --set refused."""
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and \
            dataclasses.is_dataclass(_default_at(path)):
        return [leaf for key, item in value.items() for leaf in _leaves([*path, key], item)]
    return [(path, value)]


def _apply_override(tree: dict, path: list[str], value: Any) -> None:
    """Set the key; a mapping given for a section or a mapping key merges into what the recipe has there, as
    nested keys would (``--set train={batch_size: 32}`` changes train.batch_size alone)."""
    node = tree
    for part in path[:-1]:
        if node.get(part) is None:  # absent, or an empty section in the file (``train:``)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise UserError(f"bad --set: {show('.'.join(path))} goes through a value that is not a section")
    if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
        for key, item in value.items():
            _apply_override(node, [path[-1], key], item)
    else:
        node[path[-1]] = value


def read_yaml(path: str) -> dict:
    shown = printable(path)
    if os.path.isdir(path):  # os.path answers False for a path holding a NUL
        raise UserError(f"config file {shown} is a folder, not a file: name the recipe YAML in it, e.g. --config "
                        f"configs/demo.yaml")
    not_dangling("--config", path)
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {shown} (pass an existing YAML, e.g. --config configs/demo.yaml)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml_load(fh)
    except DuplicateKey as exc:
        raise UserError(f"config file {shown} line {exc.line}: key {show(exc.key)} appears twice in one section "
                        f"(first at line {exc.first_line}), and YAML would keep only the second: merge them into "
                        f"one") from None
    except UnsafeTag as exc:
        raise UserError(f"config file {shown} line {exc.line}: the tag {show(exc.tag)} {UNSAFE_FIX}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {shown} is not valid YAML{where}: fix its syntax") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {shown} is not UTF-8 text: give the recipe YAML, e.g. "
                        f"configs/demo.yaml") from None
    except RecursionError:
        raise UserError(f"config file {shown} nests too deeply to be a recipe: fix it") from None
    except ValueError as exc:  # a value PyYAML matches but cannot build, e.g. the date 2020-13-45
        raise UserError(f"config file {shown} holds a value YAML cannot read ({str(exc)[:80]}): quote it or fix "
                        f"it") from None
    except OSError as exc:
        raise UserError(f"config file {shown} cannot be read ({exc.strerror}): fix its permissions") from None
    if data is None:
        raise UserError(f"config file {shown} is empty (or holds only comments), so every key would keep its default: "
                        f"write the recipe's sections in it (see configs/demo.yaml)")
    if not isinstance(data, dict):
        raise UserError(f"config file {shown} must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | None = None, overrides: list[str] | None = None, for_command: str | None = None) -> Config:
    """The validated config of a recipe file (None: the defaults) and ``--set`` overrides. ``for_command``: also
    check the path keys that command uses on this machine (:func:`check_paths`)."""
    moved: list[tuple[str, str]] = []
    tree = move_renamed_keys(read_yaml(path), f"in {printable(path)}", moved) if path else {}
    by_name: dict[str, set[str]] = {"old": set(), "new": set()}  # --set keys of MOVED_KEYS, by the name given
    for text in overrides or []:
        key_path, value = parse_override(text)
        for leaf, item in _leaves(key_path, value):
            leaf = _current_name(leaf, moved, by_name)
            _apply_override(tree, leaf, _as_written(leaf, item, text) if item is value else item)
    cfg = config_from_dict(tree, "by --set", moved)
    if for_command == "train":
        warn_unread_optimizer_keys(cfg)
    if for_command:
        check_paths(cfg, for_command)
    return cfg


def warn_unread_optimizer_keys(cfg: Config) -> None:
    """One line (rank 0's) naming the optim keys set away from their defaults that optim.name does not read: a
    recipe's keys for another optimizer (an experiment's rows change optim.name over one recipe, so not a refusal)."""
    defaults, o = OptimConfig(), cfg.optim
    unread = [f"optim.{key}" for key, users in OPTIMIZER_KEYS.items()
              if o.name not in users and getattr(o, key) != getattr(defaults, key)]
    if unread and launcher_rank() == 0:
        print(f"hybridtrain: warning: config: {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} set but "
              f"optim.name={o.name} does not read {'it' if len(unread) == 1 else 'them'} (ignored): drop "
              f"{'it' if len(unread) == 1 else 'them'}, or choose the optimizer that does", file=sys.stderr,
              flush=True)


def config_from_dict(tree: dict, where: str = "in the mapping", moved: list[tuple[str, str]] | None = None) -> Config:
    moved = [] if moved is None else moved  # load_config's: the keys its recipe file gave by their old names
    tree = move_renamed_keys(tree, where, moved)
    warn_moved(moved)
    return validate(build(Config, tree))


# ----------------------------------------------------------------------------- keys that moved

# old dotted key -> its new one. The old name still works, with one warning line (rank 0's) naming the new one;
# giving both is refused. What both engines honour (the all-reduce's compression, the limits) left
# horovod: for distributed:.
MOVED_KEYS = {"horovod.compression": "distributed.compression",
              "horovod.stall_warning_s": "distributed.stall_warning_s",
              "horovod.stall_shutdown_s": "distributed.stall_shutdown_s",
              "horovod.gloo_timeout_s": "distributed.gloo_timeout_s"}


def warn_moved(moved: list[tuple[str, str]]) -> None:
    """One line per moved key given by its old name, once the config holds no key under both names."""
    for old, new in moved if launcher_rank() == 0 else ():  # one line per job, not one per rank
        print(f"hybridtrain: warning: config: {old} moved to {new}; it still works, rename it", file=sys.stderr,
              flush=True)


def both_names(old: str, new: str, where: str) -> UserError:
    return UserError(f"config error: {old} (the old name) and {new} are both given {where}: keep {new} only")


def move_renamed_keys(tree: dict, where: str, moved: list[tuple[str, str]]) -> dict:
    """``tree`` with each old key of :data:`MOVED_KEYS` under its new name, added to ``moved`` (the caller's
    mapping is not changed)."""
    for old, new in MOVED_KEYS.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section, target = tree.get(old_section), tree.get(new_section)
        if not isinstance(section, dict) or old_key not in section or not isinstance(target, (dict, type(None))):
            continue  # nothing to move, or a section that is no mapping (build refuses it)
        if target is not None and new_key in target:
            raise both_names(old, new, where)
        value = section[old_key]
        tree = {**tree, old_section: {k: v for k, v in section.items() if k != old_key},
                new_section: {**(target or {}), new_key: value}}
        moved.append((old, new))
    return tree


def _current_name(key_path: list[str], moved: list[tuple[str, str]], by_name: dict[str, set[str]]) -> list[str]:
    """A --set key under its current name (an old one added to ``moved``); one line when the old and the new
    name of one key are both given by --set (a --set of either name overrides the recipe's)."""
    dotted = ".".join(key_path)
    new = MOVED_KEYS.get(dotted)
    if new:
        moved.append((dotted, new))
    by_name["old" if new else "new"].add(new or dotted)
    for clash in by_name["old"] & by_name["new"]:
        raise both_names(next(old for old, renamed in MOVED_KEYS.items() if renamed == clash), clash, "by --set")
    return new.split(".") if new else key_path


def save_config(cfg: Config, path: str) -> None:
    write_text_atomically(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
