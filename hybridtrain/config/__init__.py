"""Declarative, validated configuration: defaults in code, one YAML per recipe, ``--set`` overrides.

Every key is public interface. ``load_config`` returns a validated :class:`Config`; any unknown key,
wrong type or out-of-range value raises :class:`UserError` with one line naming the key and what is allowed.

One job per module, each importing only those above it in this list: ``sections`` (the dataclasses: every key, its
default, bounds and doc), ``coercion`` (a mapping built into the sections: types, ranges, unknown keys with the key
meant), ``rules`` (cross-key rules and values resolved from several keys), ``paths`` (the path keys checked on this
machine), ``loading`` (the strict YAML reader, ``--set``, the keys that moved, :func:`load_config`). This module
re-exports the names the rest of the package and the tests use.
"""
from hybridtrain.config.coercion import all_keys, suggest_key
from hybridtrain.config.loading import config_from_dict, load_config, parse_override, save_config
from hybridtrain.config.paths import PATH_USES, check_paths, check_run_dir
from hybridtrain.config.rules import gradient_compression, loss_scaling
from hybridtrain.config.sections import OPTIMIZER_FLAGS, STAGES, Config, OptimConfig, PrecisionConfig

__all__ = ["OPTIMIZER_FLAGS", "PATH_USES", "STAGES", "Config", "OptimConfig", "PrecisionConfig", "all_keys",
           "check_paths", "check_run_dir", "config_from_dict", "gradient_compression", "load_config", "loss_scaling",
           "parse_override", "save_config", "suggest_key"]
