"""What one rank trains with, built once from the config: data, model, optimizer, precision
and the step."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hybridtrain.config import Config, gradient_compression
from hybridtrain.data.loaders import create_loaders
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine import checkpoint
from hybridtrain.engine.breakdown import startup_mark
from hybridtrain.engine.ema import create_ema
from hybridtrain.engine.records import SampleAudit, audit_path
from hybridtrain.engine.sinks import log
from hybridtrain.engine.step import build_step
from hybridtrain.errors import UserError
from hybridtrain.hardware.checks import check_machine, check_node
from hybridtrain.models import model_from_config
from hybridtrain.models.batchnorm import configure_batch_norm
from hybridtrain.optim import create_optimizer
from hybridtrain.precision.policy import prepare_model, set_fp32_math
from hybridtrain.precision.scaler import Precision, create_precision


@dataclass
class Trainer:
    """Everything one rank trains with."""
    topo: object
    data: object
    model: torch.nn.Module
    precision: Precision
    bundle: object
    updates: int  # optimizer steps per epoch
    k: int  # accumulation steps
    batch_size: int  # per rank and pass (train.batch_size)
    step: object  # forward and backward, eager, compiled or graphed (step.build_step)
    compression: str = "none"  # the gradient all-reduce's wire, resolved from distributed.compression
    fp32_math: str = "ieee"  # FP32 convolutions and matmuls: ieee or tf32
    audit: object = None  # records.SampleAudit: the trained samples' indices (elastic.audit_samples)
    ema: object = None  # ema.WeightEMA of the weights (train.ema_decay > 0), else None
    profiler: object = None  # profiling.StepProfiler (train --profile), stepped after every step; set by the loop

    def state_dict(self) -> dict:
        """The trainer's run state, written once: what a checkpoint holds (resume.checkpoint_state), what a resume
        (resume.restore) and an elastic commit, roll-back or sync (elastic.ElasticState) restore, each with the
        position in training on top: the model (with BN buffers), the optimizer (phase, moments, momentum) and the
        loss scaler; and the weights' EMA (train.ema_decay)."""
        state = {"model": self.model.state_dict(), "optimizer": self.bundle.optimizer.state_dict(),
                 "scaler": self.precision.scaler.state_dict()}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s parts from ``state``; one line when it was made for another model or optimizer
        (checkpoint.restore). Checkpoints of older versions hold no scaler: it keeps its initial state."""
        checkpoint.restore(state, self.model, self.bundle.optimizer)  # the optimizer's also drops Horovod's pending
        if "scaler" in state:                                          # all-reduces (an elastic roll-back)
            self.precision.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:  # a checkpoint without one (the EMA switched on at a resume) starts it here
            self.ema.load_state_dict(state["ema"]) if "ema" in state else self.ema.reset()


def build_trainer(cfg: Config, topo) -> Trainer:
    """Everything a rank trains with, on the device ``topo`` (distributed.init) bound it to."""
    if cfg.train.deterministic:  # bitwise-repeatable runs (and exact resumes) at some cost in speed
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif cfg.bn.per_rank_batch == "fixed":
        torch.backends.cudnn.benchmark = True  # fixed shapes: cuDNN picks the fastest kernels once
    else:  # a new batch size almost every step would be autotuned anew every time
        torch.backends.cudnn.benchmark = False
        log(topo, "hybridtrain: bn.per_rank_batch=random: cuDNN autotuning off (the batch size changes every step)")
    fp32_math = set_fp32_math(cfg.precision.tf32)
    precision = create_precision(cfg.precision)
    policy = precision.policy
    compression = gradient_compression(cfg.distributed.compression, cfg.precision)
    for warning in check_node(topo.device, cfg.precision):  # kernels, driver, bf16: one refusal line, or warnings
        log(topo, f"hybridtrain: {warning}")
    check_machine(cfg, policy, topo.device)
    data = create_loaders(cfg, topo, policy.input_dtype)
    startup_mark("data_scan")
    if not cfg.train.cuda_graphs:
        data.start()  # the workers start while the model is built
        startup_mark("loader_start")
    model = model_from_config(cfg.model, data.num_classes, seed=cfg.seed).to(topo.device)
    model = prepare_model(configure_batch_norm(model, cfg.bn, topo.device), policy)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    k = cfg.train.accumulation_steps
    updates = data.steps_per_epoch // k
    if updates == 0:
        raise UserError(f"train.accumulation_steps={k} is more than the {data.steps_per_epoch} batches per epoch: "
                        f"lower it, or train.batch_size")
    # N of lr*N and of the bounds counts per-rank batches per update: ranks x accumulation steps (global batch / b)
    bundle = create_optimizer(model, cfg, topo.size * k, updates)
    # the engine's step contract: the forward through its wrapper (DDP), the update through its optimizer
    # (Horovod's); a CUDA graph is captured before Horovod's hooks exist
    step = build_step(model, cfg, precision, wrap=lambda m: distributed.wrap_model(m, cfg, compression))
    if cfg.train.cuda_graphs:  # after the capture: no pin-memory thread runs CUDA calls during it
        data.start()
    # Wrap first: Horovod rebuilds the optimizer from its param_groups, so state loaded before would be lost.
    bundle.optimizer = distributed.wrap_optimizer(bundle.optimizer, model, cfg, k, compression)
    return Trainer(topo, data, model, precision, bundle, updates, k, cfg.train.batch_size, step, compression,
                   fp32_math, audit=SampleAudit(audit_path(cfg)), ema=create_ema(model, cfg.train))
