"""A trained model as the commands after training read it: a run folder (its newest checkpoint), one checkpoint, or a
``final_model.pt`` beside its run's ``config.yaml``. The file's SHA-256 is checked and it is loaded weights-only
(``checkpoint.load_verified``); the model is built as the trainer built it (``models``, ``precision``), so its
figures are the run's; the class names are those of the data the run trained on."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from hybridtrain.config import Config, load_config
from hybridtrain.config.loading import config_from_dict
from hybridtrain.data.folder import read_text_lines, scan_split
from hybridtrain.engine import checkpoint, rundir
from hybridtrain.errors import UserError
from hybridtrain.files import check_input_file
from hybridtrain.models import model_from_config
from hybridtrain.precision.policy import prepare_model

FINAL = "final_model.pt"


@dataclass
class Trained:
    path: str  # the file the weights came from
    run_dir: str  # the folder holding it
    cfg: Config  # the run's config (the checkpoint's own, or config.yaml beside final_model.pt)
    weights: dict  # the state dict of the chosen weights
    which: str  # "raw" or "ema"
    epoch: int | None  # epochs the checkpoint completed; None for final_model.pt
    num_classes: int
    classes: list[str] | None  # the run's class names in label order, None when its data is out of reach
    words: dict[str, str]  # class name -> its words (WordNet's, from the data's classes.txt)

    def label(self, index: int) -> str:
        """Class ``index`` by its name and, where known, its words ('n01440764 tench, Tinca tinca')."""
        if self.classes is None:
            return str(index)
        name = self.classes[index]
        return f"{name} {self.words[name]}" if name in self.words else name


def model_file(path: str) -> str:
    """The weights file of ``path``: itself, or in a run folder its newest checkpoint (final_model.pt when none)."""
    if not os.path.isdir(path):
        return check_input_file(path, "the model", "give a run folder, a checkpoint-epoch*.pt or a final_model.pt")
    found = rundir.list_checkpoints(path)
    if found:
        return found[-1][1]
    if os.path.isfile(os.path.join(path, FINAL)):
        return os.path.join(path, FINAL)
    raise UserError(f"{path} holds no checkpoint-epoch*.pt and no {FINAL}: give the run_dir of a run that trained "
                    f"at least one epoch, or the model file itself")


def read_state(path: str):
    """The verified, weights-only content of ``path``, or one line naming it and why it is refused."""
    try:
        return checkpoint.load_verified(path)
    except ValueError as exc:
        raise UserError(f"{path} cannot be used: {exc}: copy it again with its .sha256 from the run, or use another "
                        f"checkpoint of the run") from None
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror or exc}): check the path and its permissions") from None


def run_config(state, path: str) -> Config:
    """A checkpoint's own config; beside a final_model.pt, its run's config.yaml."""
    if isinstance(state, dict) and isinstance(state.get("config"), dict):
        return config_from_dict(state["config"], f"in {path}'s config")
    saved = os.path.join(os.path.dirname(os.path.abspath(path)), "config.yaml")
    if not os.path.isfile(saved):
        raise UserError(f"{path} holds weights alone and there is no config.yaml beside it to say how they were "
                        f"trained: keep final_model.pt in its run folder, or give a checkpoint-epoch*.pt")
    return load_config(saved)


def chosen_weights(state, cfg: Config, path: str, which: str | None) -> tuple[dict, str]:
    """(state dict, "raw"|"ema"): ``which``, by default the run's train.final_weights."""
    which = which or cfg.train.final_weights
    if "model" in state and "epoch" in state:  # a checkpoint: the raw weights and, with train.ema_decay, their EMA
        if which == "raw":
            return state["model"], which
        if "ema" not in state:
            raise UserError(f"{path} holds no EMA of the weights (the run had train.ema_decay=0): leave --weights out "
                            f"or pass --weights raw")
        return state["ema"]["shadow"], which
    if not all(torch.is_tensor(v) for v in state.values()):
        raise UserError(f"{path} is neither a hybridtrain checkpoint nor a final_model.pt (a dict of tensors): give a "
                        f"run folder or one of its model files")
    if which != cfg.train.final_weights:
        raise UserError(f"{path} holds the run's {cfg.train.final_weights} weights only (train.final_weights): for "
                        f"the {which} ones give the run folder or a checkpoint-epoch*.pt")
    return state, which


def load_trained(path: str, which: str | None = None) -> Trained:
    """The trained model at ``path`` (a run folder or a model file) with ``which`` weights (default: the run's
    train.final_weights)."""
    file = model_file(path)
    state = read_state(file)
    if not isinstance(state, dict):
        raise UserError(f"{file} is not a hybridtrain model file (it holds a {type(state).__name__})")
    cfg = run_config(state, file)
    weights, which = chosen_weights(state, cfg, file, which)
    fc = weights.get("fc.weight")
    if not torch.is_tensor(fc) or fc.dim() != 2:
        raise UserError(f"{file} holds no fc.weight of a ResNet classifier: give a hybridtrain run's model file")
    run_dir = os.path.dirname(os.path.abspath(file))
    classes, words = run_classes(cfg, run_dir, fc.shape[0])
    epoch = state["epoch"] + 1 if "epoch" in state and "model" in state else None
    return Trained(file, run_dir, cfg, weights, which, epoch, fc.shape[0], classes, words)


def run_data_path(cfg: Config, run_dir: str) -> str | None:
    """The run's data.path as seen from here: as written, or, when relative and not found from here, from the folder
    the run was started in (where run_dir's relative path leads to this run folder); None when out of reach."""
    data = cfg.data.path
    if os.path.isabs(data) or os.path.isdir(data):
        return data if os.path.isdir(data) else None
    tail = os.sep + os.path.normpath(cfg.run_dir)
    if not os.path.isabs(cfg.run_dir) and run_dir.endswith(tail):
        started_in = run_dir[:-len(tail)] or os.sep
        if os.path.isdir(os.path.join(started_in, data)):
            return os.path.join(started_in, data)
    return None


def read_class_names(data: str) -> tuple[list[str], dict[str, str]]:
    """The class names of prepare-data's classes.txt (one a line, in label order) and their words from its
    synset_words.txt ('n01440764 tench, Tinca tinca' lines), where the source gave them."""
    names = [line.strip() for line in read_text_lines(os.path.join(data, "classes.txt")) if line.strip()]
    words, listing = {}, os.path.join(data, "synset_words.txt")
    for line in read_text_lines(listing) if os.path.isfile(listing) else []:
        name, _, text = line.strip().partition(" ")
        if text.strip():
            words[name] = text.strip()
    return names, words


def run_classes(cfg: Config, run_dir: str, num_classes: int) -> tuple[list[str] | None, dict[str, str]]:
    """The run's class names in label order (its data's classes.txt, else its train/ class folders) and their words;
    (None, {}) with a warning when the data is out of reach or does not match the model."""
    data = run_data_path(cfg, run_dir)
    names, words = None, {}
    if data is not None:
        if os.path.isfile(os.path.join(data, "classes.txt")):
            names, words = read_class_names(data)
        elif os.path.isdir(os.path.join(data, "train")):
            names = scan_split(data, "train").classes
    if names is None or len(names) != num_classes:
        why = (f"its data.path={cfg.data.path} is not found from here" if names is None else
               f"its data.path={cfg.data.path} has {len(names)} classes, the model {num_classes}")
        print(f"hybridtrain: warning: the run's class names are unknown ({why}): classes are shown by their index",
              file=sys.stderr)
        return None, {}
    return names, words


def build_model(trained: Trained, device: torch.device, policy) -> torch.nn.Module:
    """The model as the trainer built it (architecture, the precision policy's dtypes, channels_last), holding the
    chosen weights, in eval mode; one line when the weights do not fit the run's architecture."""
    cfg = trained.cfg
    model = prepare_model(model_from_config(cfg.model, trained.num_classes).to(device), policy)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    try:
        model.load_state_dict(trained.weights)
    except RuntimeError:
        raise UserError(f"{trained.path} does not fit model.arch={cfg.model.arch} of its config: "
                        f"{checkpoint._model_mismatch(model, trained.weights)}: give the model file with the "
                        f"config.yaml of its own run") from None
    return model.eval()
