"""Cross-key rules: what a single key's bounds cannot express, and the values resolved from several keys
(loss scaling, the gradient compression)."""
from __future__ import annotations

from hybridtrain.config.coercion import show
from hybridtrain.config.sections import OPTIMIZER_FLAGS, SCHEDULED, STAGES, Config
from hybridtrain.errors import UserError


def validate(cfg: Config) -> Config:
    """Cross-field checks that a single key cannot express."""
    if cfg.optim.name == "hybrid" and cfg.optim.adabound_epochs >= cfg.train.epochs:
        raise UserError(f"config error: optim.adabound_epochs (T={cfg.optim.adabound_epochs}) must be in "
                        f"[1, train.epochs={cfg.train.epochs}): the SGD phase needs at least one epoch")
    if cfg.optim.name in ("goyal", "mlperf") and cfg.optim.warmup_epochs >= cfg.train.epochs:
        raise UserError(f"config error: optim.warmup_epochs ({cfg.optim.warmup_epochs}) must be smaller "
                        f"than train.epochs ({cfg.train.epochs})")
    if cfg.optim.fused and "fusable" not in OPTIMIZER_FLAGS[cfg.optim.name]:
        fusable = " and ".join(name for name, flags in OPTIMIZER_FLAGS.items() if "fusable" in flags)
        raise UserError(f"config error: optim.fused applies to the {fusable} optimizers, and optim.name="
                        f"{cfg.optim.name} runs torch.optim.SGD (already multi-tensor): drop optim.fused")
    validate_recipe(cfg)
    validate_precision(cfg)
    validate_data(cfg)
    if cfg.bn.sync and cfg.model.bn_swap:
        raise UserError("config error: bn.sync cannot be combined with model.bn_swap (the swapped BN computes its "
                        "statistics itself): switch one of them off")
    if cfg.bn.per_rank_batch == "random" and cfg.data.backend != "torchvision":
        raise UserError(f"config error: bn.per_rank_batch=random needs data.backend=torchvision (data.backend="
                        f"{cfg.data.backend} delivers fixed batches): switch the backend or use per_rank_batch=fixed")
    if cfg.train.compile_scope != "blocks" and not cfg.train.compile:
        raise UserError(f"config error: train.compile_scope={cfg.train.compile_scope} only applies with "
                        f"train.compile=true: set train.compile=true or drop train.compile_scope")
    validate_cuda_graphs(cfg)
    d = cfg.distributed
    if 0 < d.stall_shutdown_s < d.stall_warning_s:
        raise UserError(f"config error: distributed.stall_shutdown_s ({d.stall_shutdown_s}) is shorter than "
                        f"distributed.stall_warning_s ({d.stall_warning_s}), and Horovod would then never shut "
                        f"down: raise it, or set 0")
    if cfg.horovod.autotune_log and not cfg.horovod.autotune:
        raise UserError("config error: horovod.autotune_log is set but horovod.autotune is false: set "
                        "horovod.autotune: true, or unset autotune_log")
    validate_sinks(cfg)
    if cfg.data.backend == "synthetic" and cfg.data.file_lists:
        raise UserError("config error: data.file_lists names real images but data.backend is synthetic: "
                        "unset one of them")
    return cfg


def loss_scaling(p) -> str:
    """precision.loss_scaling resolved: ``auto`` is dynamic whenever FP16 computes anything (mixed fp16, a layered
    fp16 stage, fp16_pure; Micikevicius et al., "Mixed precision training"), else none."""
    computes_fp16 = (p.mode == "fp16_pure" or (p.mode == "mixed" and p.compute_dtype == "fp16")
                     or (p.mode == "layered" and "fp16" in p.layers.values()))
    return p.loss_scaling if p.loss_scaling != "auto" else ("dynamic" if computes_fp16 else "none")


def gradient_compression(name: str, p) -> str:
    """distributed.compression resolved for a ``precision`` section: ``auto`` is fp16 (the paper) when the loss is
    scaled, so that small gradients stay above FP16's subnormals (6.1e-5), else none. fp16 is refused for
    unscaled gradients (15% of ResNet's fall below 6.1e-5 at step 0) and for fp64 ones (they would silently
    travel as fp16)."""
    scaled = loss_scaling(p) != "none"
    if name == "auto":
        return "fp16" if scaled and p.mode != "fp64" else "none"
    if name == "fp16" and p.mode == "fp64":
        raise UserError("config error: distributed.compression=fp16 would send fp64 gradients as fp16: use auto "
                        "or none")
    if name == "fp16" and not scaled:
        raise UserError(f"config error: distributed.compression=fp16 needs loss scaling, and precision.mode="
                        f"{p.mode} has none here (unscaled gradients below 6.1e-5 lose bits in fp16, many "
                        f"flush to 0): set precision.loss_scaling=dynamic, or distributed.compression=auto or none")
    return name


def validate_precision(cfg: Config) -> None:
    p = cfg.precision
    for stage, dtype in p.layers.items():
        if stage not in STAGES:
            raise UserError(f"config error: precision.layers names stage {show(stage)}, which a ResNet lacks: "
                            f"use {', '.join(STAGES)}")
        if dtype not in ("fp32", "fp16", "bf16"):
            raise UserError(f"config error: precision.layers.{stage} must be fp32, fp16 or bf16; got {show(dtype)}")
    if p.mode == "fp16_pure" and "needs_fp32_state" in OPTIMIZER_FLAGS[cfg.optim.name]:
        raise UserError(f"config error: precision.mode=fp16_pure keeps optimizer state in FP16, but optim.name="
                        f"{cfg.optim.name} needs FP32 state (AdaBound's squared gradients): use optim.name=goyal "
                        f"or sgd, or precision.mode=mixed")
    gradient_compression(cfg.distributed.compression, p)


def validate_cuda_graphs(cfg: Config) -> None:
    """A graph replays one batch shape with no collective inside the forward pass and one pass per step."""
    clash = ("train.accumulation_steps > 1" if cfg.train.accumulation_steps > 1 else
             "bn.per_rank_batch=random" if cfg.bn.per_rank_batch == "random" else
             "bn.sync=true" if cfg.bn.sync else None)
    if cfg.train.cuda_graphs and clash:
        raise UserError(f"config error: train.cuda_graphs cannot replay a step with {clash} (one static batch, no "
                        f"all-reduce in the forward pass): switch one of them off")


def validate_data(cfg: Config) -> None:
    if cfg.data.in_process and cfg.data.backend != "torchvision":
        raise UserError(f"config error: data.in_process applies to data.backend=torchvision (data.backend="
                        f"{cfg.data.backend} has no worker processes to leave out): drop data.in_process")
    if cfg.data.in_process and cfg.data.workers:
        raise UserError(f"config error: data.in_process=true starts no loader workers, so data.workers="
                        f"{cfg.data.workers} would be ignored: drop one of them")
    if cfg.data.backend == "dali_gpu" and cfg.train.device == "cpu":  # decoding on a GPU to copy back to the CPU
        raise UserError("config error: data.backend=dali_gpu decodes on the GPU but train.device=cpu trains on the "
                        "CPU: set train.device=cuda or auto, or use data.backend=dali_cpu")
    validate_progressive(cfg)


def validate_progressive(cfg: Config) -> None:
    """Progressive resizing (data.res_*, data/resolution.py): low to high, on multiples of data.res_multiple, the
    ramp inside the run and its last epoch at data.res_end (BN's last-iteration statistics are taken there)."""
    d, epochs = cfg.data, cfg.train.epochs
    if not d.res_start:
        stray = [f"data.{key}" for key in ("res_end", "res_start_epoch", "res_end_epoch") if getattr(d, key)]
        stray += ["data.res_multiple"] if d.res_multiple != 32 else []
        if stray:
            raise UserError(f"config error: {stray[0]} applies to progressive resizing, which data.res_start=0 "
                            f"leaves off: set data.res_start (the first epochs' resolution), or drop {stray[0]}")
        return
    if d.backend == "synthetic":
        raise UserError("config error: progressive resizing (data.res_start) resizes images, and data.backend="
                        "synthetic has none (its batches are data.crop_size): use torchvision or dali_cpu/dali_gpu, "
                        "or set data.res_start=0")
    if not 8 <= d.res_start <= d.res_end:
        raise UserError(f"config error: progressive resizing goes from low to high resolution: 8 <= data.res_start "
                        f"<= data.res_end needed, got data.res_start={d.res_start}, data.res_end={d.res_end}")
    if d.res_start % d.res_multiple or d.res_end % d.res_multiple:
        raise UserError(f"config error: data.res_start ({d.res_start}) and data.res_end ({d.res_end}) must be "
                        f"multiples of data.res_multiple ({d.res_multiple}), as the epochs between them are")
    if not d.res_start_epoch < d.res_end_epoch < epochs:
        raise UserError(f"config error: progressive resizing needs data.res_start_epoch < data.res_end_epoch < "
                        f"train.epochs, got {d.res_start_epoch}, {d.res_end_epoch}, {epochs} (0-based epochs; the "
                        f"last epoch trains at data.res_end, where BN's last-iteration statistics are taken)")


# the tracking URIs sinks.mlflow takes, by scheme: MLflow's file store, a tracking server, a database store
MLFLOW_SCHEMES = ("file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")


def validate_sinks(cfg: Config) -> None:
    """sinks.mlflow is off, local or a tracking URI MLflow takes (a bare word such as 'true' would be a relative
    file store, made in whatever folder the run starts in); sinks.project a name both trackers take."""
    uri, project = cfg.sinks.mlflow, cfg.sinks.project
    scheme = uri.split(":", 1)[0].split("+", 1)[0] if ":" in uri else ""
    if uri not in ("", "local") and (scheme not in MLFLOW_SCHEMES or (scheme == "file" and not
                                     uri.removeprefix("file:").removeprefix("//").startswith("/"))):
        raise UserError(f"config error: sinks.mlflow={show(uri)} is not a form it takes: '' (off), local (a file "
                        f"store in run_dir/mlruns), file:/absolute/path, http://host:5000 (a tracking server) or "
                        f"sqlite:///path/mlflow.db (with the full mlflow package)")
    if not project.strip() or len(project) > 128 or any(c in project for c in "/\\#?%:"):
        raise UserError(f"config error: sinks.project={show(project)} must be a name of 1 to 128 characters without "
                        f"/ \\ # ? % : (the MLflow experiment and the W&B project)")


def validate_recipe(cfg: Config) -> None:
    """The recipes' options: the EMA's and the schedule's choices (train.label_smoothing's range is its key's, its
    default resolved as the Config is made: Config.__post_init__)."""
    t, o = cfg.train, cfg.optim
    if t.final_weights == "ema" and t.ema_decay == 0:
        raise UserError("config error: train.final_weights=ema needs an EMA of the weights: set train.ema_decay "
                        "(e.g. 0.999), or train.final_weights=raw")
    if o.schedule != "step" and o.name not in SCHEDULED:
        raise UserError(f"config error: optim.schedule={o.schedule} applies to optim.name {' or '.join(SCHEDULED)}, "
                        f"and optim.name={o.name} has its own schedule: drop optim.schedule")
