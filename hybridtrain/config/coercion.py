"""Building the sections from a mapping: each value checked against its key's declared type, choices and range,
an unknown key refused with the key it was meant to be, and values shown short in the error lines."""
from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
from typing import Any

from hybridtrain.config.sections import Config
from hybridtrain.errors import UserError

_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = 80, 80, 40, 3
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 6
show = _REPR.repr  # a value for an error line: one line, at most ~100 characters, and cheap even for a YAML alias bomb


def printable(text: str) -> str:
    """A path as written when it prints on one line, else its escaped repr (a newline in a name stays one line)."""
    return text if text.isprintable() else show(text)


def all_keys(cls=None, prefix: str = "") -> list[str]:
    """Every dotted key of the config, sections included (``train``, ``train.epochs``, ...)."""
    keys = []
    for f in dataclasses.fields(cls or Config):
        keys.append(prefix + f.name)
        default = default_of(f)
        if dataclasses.is_dataclass(default):
            keys += all_keys(type(default), f"{prefix}{f.name}.")
    return keys


def _nearest(key: str, names: list[str], cutoff: float = 0.6) -> str | None:
    """The name difflib finds nearest to ``key`` (similarity at least ``cutoff``) when no other is as near, else None:
    a tie is no clear meaning. 0.6 takes a typo and a shortened name (``crop`` -> ``crop_size``, ``accum_steps`` ->
    ``accumulation_steps``, ``classes`` -> ``num_classes``)."""
    found = difflib.get_close_matches(key, names, n=2, cutoff=cutoff)
    ratios = [difflib.SequenceMatcher(None, key, name).ratio() for name in found]
    return found[0] if found and (len(found) == 1 or ratios[0] > ratios[1]) else None


def suggest_key(dotted: str) -> str | None:
    """The key that an unknown dotted key was meant to be: the same name in another section (``data.batch_size`` ->
    ``train.batch_size``, not ``data.val_batch_size``); else a near or shortened name in its section; else a name a
    letter off in another section. None when no key is clearly meant: a wrong guess would set another key."""
    section, _, key = dotted.rpartition(".")
    keys = all_keys()
    sections = {k.rpartition(".")[0] for k in keys}
    elsewhere = [k for k in keys if k.rpartition(".")[0] != section and k not in sections]  # keys, not sections
    same = [k for k in elsewhere if k.rpartition(".")[2] == key]
    if len(same) == 1:
        return same[0]
    near = _nearest(key, [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section])
    if near is not None:
        return f"{section}.{near}" if section else near
    near = _nearest(key, [k.rpartition(".")[2] for k in elsewhere], cutoff=0.9) if len(key) >= 5 else None
    found = [k for k in elsewhere if k.rpartition(".")[2] == near]
    return found[0] if not same and len(found) == 1 else None


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


# a key's type -> what its error line says it must be (float: _as_float)
KINDS = {bool: "true or false", int: "an integer", str: "a string", list: "a list", dict: "a mapping"}


def _coerce(value: Any, f: dataclasses.Field, dotted: str):
    """Check a value against a field's declared type and constraints; return it typed."""
    default = default_of(f)
    meta = f.metadata
    if value is None and default is None:  # left unset: resolved as the Config is made
        return None
    expected = meta.get("kind") or type(default)
    if expected in KINDS and (not isinstance(value, expected) or isinstance(value, bool) != (expected is bool)):
        unquoted = expected is str and (value is None or isinstance(value, (bool, int, float)))
        hint = (f" (YAML reads that unquoted value as a {type(value).__name__}: to mean the text, quote it, e.g. "
                f"{dotted.rpartition('.')[2]}: \"...\")" if unquoted else "")
        raise UserError(f"config error: {dotted} must be {KINDS[expected]}, got {show(value)}{hint}")
    if expected is float:
        value = _as_float(value, meta, dotted)
    elif expected is str and "\0" in value:
        raise UserError(f"config error: {dotted} holds a NUL character (\\0), which no path or name may hold: "
                        f"remove it")
    elif "items" in meta:  # a list of numbers
        value = _check_numbers(value, meta, dotted)
    elif expected is dict:
        value = {**default, **value}  # a partial mapping overrides only the keys it names
    if "choices" in meta and value not in meta["choices"]:
        allowed = ", ".join(str(c) for c in meta["choices"])
        raise UserError(f"config error: {dotted} must be one of: {allowed}; got {show(value)}")
    _check_range(value, meta, dotted)
    return value


def _span(meta) -> str:
    """The allowed values as the error line writes them, e.g. [1, 65536], (0.0, inf), or [0.0, 1.0) or null for a key
    whose default is None (resolved from other keys)."""
    lo, hi = meta.get("lo"), meta.get("hi")
    left = "(" if meta.get("lo_open") or lo is None else "["
    right = ")" if meta.get("hi_open") or hi is None else "]"
    unset = " or null (the default resolved from other keys)" if meta.get("kind") else ""
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}{unset}"


def _as_float(value, meta, dotted) -> float:
    """A real, finite number as float: NaN and +-inf are refused for every key (none gives infinity a meaning)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str):
            try:
                if math.isfinite(float(value)):
                    hint = f" (quoted, {value} is text: write it without quotes)"
            except ValueError:
                pass
        raise UserError(f"config error: {dotted} must be a number, got {show(value)}{hint}")
    try:
        number_ = float(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        number_ = math.inf if value > 0 else -math.inf
    if not math.isfinite(number_):
        raise UserError(f"config error: {dotted} must be a finite number in {_span(meta)}, got {show(value)} "
                        f"(NaN and infinity are never allowed)")
    return number_


def _check_numbers(values: list, meta, dotted) -> list:
    """A list of finite numbers, each in the declared range, of the declared length, increasing if declared."""
    items = meta["items"]
    length = meta.get("length")
    increasing = "strictly increasing " if meta.get("increasing") else ""
    what = (f"{'two' if length == 2 else length} {increasing}numbers" if length else
            f"a {increasing}list of numbers") + f" in {_span(items)}"
    wrong = f"config error: {dotted} must be {what}, got {show(values)}"
    if length is not None and len(values) != length:
        raise UserError(wrong)
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UserError(wrong)
        out.append(_as_float(v, items, f"{dotted}[{i}]"))
        _check_range(out[-1], items, f"{dotted}[{i}]")
    if meta.get("increasing") and any(b <= a for a, b in zip(out, out[1:])):
        raise UserError(wrong)
    return out


def _check_range(value, meta, dotted):
    lo, hi = meta.get("lo"), meta.get("hi")
    too_low = lo is not None and (value <= lo if meta.get("lo_open") else value < lo)
    too_high = hi is not None and (value >= hi if meta.get("hi_open") else value > hi)
    if too_low or too_high:
        raise UserError(f"config error: {dotted} must be in {_span(meta)}, got {show(value)}")


def build(cls, values: dict, prefix: str = ""):
    if not isinstance(values, dict):
        raise UserError(f"config error: section '{prefix.rstrip('.') or 'top level'}' must be a mapping, got "
                        f"{show(values)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            near = suggest_key(str(dotted))
            meant = f" (did you mean '{near}'?)" if near else ""
            raise UserError(f"config error: unknown key '{show(dotted)[1:-1]}'{meant}; allowed here: "
                            f"{', '.join(fields)}")
        f = fields[key]
        default = default_of(f)
        if dataclasses.is_dataclass(default):
            kwargs[key] = build(type(default), {} if value is None else value, f"{dotted}.")
        else:
            kwargs[key] = _coerce(value, f, dotted)
    return cls(**kwargs)
