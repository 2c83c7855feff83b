"""``python -m tools experiment NAME``: named comparisons, each run as real Horovod jobs.

Every experiment has one form: a list of named rows, each a set of ``--set`` overrides on one recipe; each
row trains under ``horovodrun``; the runner writes ``NAME.md`` (a table), ``NAME.json`` (one record per row)
and ``NAME.png`` (train and val top-1 per epoch, as the paper's Fig 3.1) into ``--out``.
"""
from __future__ import annotations

import os
import re

from hybridtrain.config import load_config
from hybridtrain.distributed.launcher import launch_command, resolve_engine, venv_tool
from hybridtrain.errors import UserError
from hybridtrain.files import figure, save_figure, write_json_atomically, write_text_atomically
from hybridtrain.reports import markdown_table
from hybridtrain.reports.paper_metrics import convergence_epoch
from hybridtrain.reports.report import load_run
from tools.jobs import run_job


def optimizer_rows(cfg) -> list[tuple[str, list[str]]]:
    """The paper's Fig 3.1: hybrid against adabound, goyal and sgd on the same data, seed and budget."""
    return [(name, [f"optim.name={name}"]) for name in ("hybrid", "adabound", "goyal", "sgd")]


PAPER_WARMUP_EPOCHS = (1, 2, 5, 10)  # Fig 3.2's T, for a 90-epoch run


def warmup_epoch_rows(cfg) -> list[tuple[str, list[str]]]:
    """The paper's Fig 3.2: T in {1, 2, 5, 10} of 90 epochs, scaled to the run (at least 1, below the
    epochs). A run too short to keep four distinct values sweeps T = 1, 2, 3, 4 (up to half the run)."""
    epochs = cfg.train.epochs
    ts = sorted({min(max(1, round(t * epochs / 90)), epochs - 1) for t in PAPER_WARMUP_EPOCHS})
    if len(ts) < len(PAPER_WARMUP_EPOCHS):
        ts = list(range(1, max(1, epochs // 2) + 1))[:len(PAPER_WARMUP_EPOCHS)]
    return [(f"T={t}", ["optim.name=hybrid", f"optim.adabound_epochs={t}"]) for t in ts]


def lars_rows(cfg) -> list[tuple[str, list[str]]]:
    """The hybrid recipe's SGD phase without LARS, with LARS scaling and with LARC clipping, at two trust
    coefficients: You et al.'s 0.001 and NVIDIA LARC's 0.02. It is how the defaults were chosen."""
    rows = [("none", ["optim.name=hybrid", "optim.lars=none"])]
    for mode in ("scale", "clip"):
        rows += [(f"{mode} eta={eta}", ["optim.name=hybrid", f"optim.lars={mode}", f"optim.trust_coefficient={eta}"])
                 for eta in (0.001, 0.02)]
    return rows


def precision_rows(cfg) -> list[tuple[str, list[str]]]:
    """The schemes of "Low precision training of deep learning models" and Lu et al. 2020's Fig 3.3: the recipe
    under every precision mode. fp16_pure keeps its optimizer state in FP16, which AdaBound cannot use, so that row
    trains with goyal and Cheng et al.'s 0.25 BN scale."""
    rows = [("fp64", ["precision.mode=fp64"]), ("fp32", ["precision.mode=fp32"]),
            ("mixed-fp16", ["precision.mode=mixed", "precision.compute_dtype=fp16"]),
            ("mixed-bf16", ["precision.mode=mixed", "precision.compute_dtype=bf16"]),
            ("layered", ["precision.mode=layered"])]
    rows += [("fp16_pure (goyal)", ["precision.mode=fp16_pure", "optim.name=goyal",
                                    f"optim.warmup_epochs={min(5, cfg.train.epochs // 3)}",
                                    "model.residual_bn_scale=0.25"])]
    return [(name, sets + OWN_SCALING) for name, sets in rows]


# each precision row with its mode's own loss scaling and all-reduce compression, whatever the recipe set
OWN_SCALING = ["precision.loss_scaling=auto", "distributed.compression=auto"]


def layered_rows(cfg) -> list[tuple[str, list[str]]]:
    """Li et al. 2023's Table 2 (layered mixed precision): the first k residual stages in FP16 (k = 0..4), the stem
    and FC in FP32."""
    rows = []
    for k in range(5):
        stages = [f"precision.layers.layer{i}={'fp16' if i <= k else 'fp32'}" for i in range(1, 5)]
        rows.append((f"{k} stage(s) fp16", ["precision.mode=layered", *stages, *OWN_SCALING]))
    return rows


def bn_rows(cfg) -> list[tuple[str, list[str]]]:
    """Lu et al. 2020's Table 3.4, top to bottom: (random batch, cross-rank, moving average) ... (fixed, per-rank,
    last iteration), the paper's strategy; then that strategy with the pooled variance (beyond the paper)."""
    return [("random, cross-rank, moving avg", ["bn.per_rank_batch=random", "bn.sync=true", "bn.stats=moving_average"]),
            ("fixed, cross-rank, moving avg", ["bn.per_rank_batch=fixed", "bn.sync=true", "bn.stats=moving_average"]),
            ("fixed, per-rank, moving avg", ["bn.per_rank_batch=fixed", "bn.sync=false", "bn.stats=moving_average"]),
            ("fixed, per-rank, last iteration", ["bn.per_rank_batch=fixed", "bn.sync=false",
                                                 "bn.stats=last_iteration"]),
            ("fixed, per-rank, last iteration, pooled", ["bn.per_rank_batch=fixed", "bn.sync=false",
                                                         "bn.stats=last_iteration", "bn.combine=pooled"])]


def init_rows(cfg) -> list[tuple[str, list[str]]]:
    """Lu et al. 2020's Table 3.5: Kaiming (fan_in), Xavier and N(0, 1) convolution weights."""
    return [(name, [f"model.conv_init={name}"]) for name in ("kaiming", "xavier", "gaussian")]


def gamma_rows(cfg) -> list[tuple[str, list[str]]]:
    """Lu et al. 2020's Table 3.6: gamma = 0 or 1 in the last BN of every residual block."""
    return [("gamma=0", ["model.zero_init_last_bn=true"]), ("gamma=1", ["model.zero_init_last_bn=false"])]


def progressive_sets(cfg) -> list[str]:
    """Progressive resizing for a recipe row, FFCV's shape scaled to the run: from about 3/4 of data.crop_size (on
    multiples of 32 from 128 px up, FFCV's 160 -> 224 at 224; of 4 below: 20 -> 28 at 28) at epoch 0 up to the crop
    at three quarters of the run, validated at the crop."""
    crop, epochs = cfg.data.crop_size, cfg.train.epochs
    multiple = 32 if crop >= 128 and crop % 32 == 0 else 4 if crop % 4 == 0 else 1
    start = max(8, multiple * round(0.75 * crop / multiple))
    end_epoch = min(epochs - 1, max(1, round(0.75 * (epochs - 1))))
    return [f"data.res_start={start}", f"data.res_end={crop}", f"data.res_multiple={multiple}",
            "data.res_start_epoch=0", f"data.res_end_epoch={end_epoch}"]


def recipe_rows(cfg) -> list[tuple[str, list[str]]]:
    """The recipes side by side: the paper's hybrid, MLPerf's (LARS, poly decay) and Goyal's, each alone
    (label smoothing 0, mlperf's default 0.1 included), with label smoothing 0.1, with the EMA of the weights (its
    rows report the EMA's top-1) and with progressive resizing (``progressive_sets``). Warmups fit the run: T and
    the linear warmup at most a quarter and a third of it."""
    epochs = cfg.train.epochs
    warmup, adabound = min(5, epochs // 3), max(1, min(cfg.optim.adabound_epochs, epochs // 4))
    bases = [("hybrid", ["optim.name=hybrid", f"optim.adabound_epochs={adabound}"]),
             ("mlperf", ["optim.name=mlperf", f"optim.warmup_epochs={warmup}"]),
             ("goyal", ["optim.name=goyal", f"optim.warmup_epochs={warmup}"])]
    ema = cfg.train.ema_decay or 0.99
    options = [("", []), (" + smoothing", ["train.label_smoothing=0.1"]),
               (" + EMA", [f"train.ema_decay={ema}", "train.final_weights=ema"]),
               (" + progressive", progressive_sets(cfg))]
    return [(name + suffix, ["train.label_smoothing=0", *sets, *extra])
            for name, sets in bases for suffix, extra in options]


EXPERIMENTS = {"optimizers": optimizer_rows, "warmup-epochs": warmup_epoch_rows, "lars": lars_rows,
               "precision": precision_rows, "layered": layered_rows, "bn": bn_rows, "init": init_rows,
               "gamma": gamma_rows, "recipes": recipe_rows}


def launch_row(config: str, overrides: list[str], run_dir: str, ranks: int, engine: str = "horovod") -> None:
    sets = [arg for o in overrides + [f"run_dir={run_dir}", "train.progress=false"] for arg in ("--set", o)]
    run_job(launch_command(engine, ranks, [venv_tool("hybridtrain"), "train", "--config", config, *sets]),
            f"experiment row failed ({' '.join(overrides)})", "see its log")


def summarise_row(name: str, run_dir: str, target: float) -> dict:
    """A row's figures; a run with the EMA of the weights (train.ema_decay) is judged by the EMA's top-1."""
    _, history = load_run(run_dir)
    key = "val_top1_ema" if all("val_top1_ema" in r for r in history) else "val_top1"
    top1 = [r[key] for r in history]
    reached = convergence_epoch(top1, target)
    return {"row": name, "final_top1": top1[-1], "best_top1": max(top1), "top1_of": key,
            "epochs_to_target": reached, "target": target,
            "time_to_target_s": sum(r["epoch_time_s"] for r in history[:reached]) if reached else None,
            "images_per_sec": sum(r["samples_seen"] for r in history) / sum(r["train_time_s"] for r in history),
            "train_time_s": sum(r["epoch_time_s"] for r in history),
            "epoch_time_s": sum(r["epoch_time_s"] for r in history) / len(history),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in history),
            "skipped_steps": sum(r["skipped_steps"] for r in history),
            "nan_epochs": sum(1 for r in history if r["train_loss"] != r["train_loss"]), "history": history}


def write_table(name: str, rows: list[dict], out: str) -> str:
    header = [name, "final top-1", "best top-1", f"epochs to top-1 >= {rows[0]['target']}", "time to target (s)",
              "time (s)", "s/epoch", "img/s", "peak MiB/rank", "skipped steps", "NaN epochs"]
    text = markdown_table(header, [[r["row"], f"{r['final_top1']:.4f}", f"{r['best_top1']:.4f}",
                                    r["epochs_to_target"] if r["epochs_to_target"] is not None else "not reached",
                                    f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "-",
                                    f"{r['train_time_s']:.1f}", f"{r['epoch_time_s']:.1f}",
                                    f"{r['images_per_sec']:.1f}",
                                    f"{r['peak_memory_mb']:.0f}", r["skipped_steps"], r["nan_epochs"]]
                                   for r in rows]) + "\n"
    write_text_atomically(os.path.join(out, f"{name}.md"), text)
    return text


def plot_rows(name: str, rows: list[dict], out: str) -> str:
    fig = figure(10, 4)
    train_ax, acc_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for r in rows:
        epochs = [h["epoch"] for h in r["history"]]
        train_ax.plot(epochs, [h["train_top1"] for h in r["history"]], marker="o", label=r["row"])
        acc_ax.plot(epochs, [h[r.get("top1_of", "val_top1")] for h in r["history"]], marker="o", label=r["row"])
    train_ax.set(xlabel="epoch", ylabel="train top-1", title="training top-1 (augmented batches)")
    acc_ax.set(xlabel="epoch", ylabel="val top-1", title="validation top-1 (EMA rows: the EMA's)")
    acc_ax.axhline(rows[0]["target"], color="grey", linestyle=":", label="target")
    acc_ax.legend(fontsize="small")
    path = os.path.join(out, f"{name}.png")
    return save_figure(fig, path)


def chosen_rows(name: str, cfg, config: str, overrides: list[str], only: list[str] | None):
    """The experiment's rows (``only``: those named, in the experiment's order), each row's recipe validated before
    any launch."""
    rows = EXPERIMENTS[name](cfg)
    if only:
        unknown = [row for row in only if row not in [row_name for row_name, _ in rows]]
        if unknown:
            raise UserError(f"experiment {name} has no row '{unknown[0]}': its rows are "
                            f"{', '.join(row_name for row_name, _ in rows)}")
        rows = [row for row in rows if row[0] in only]
    for row_name, row_sets in rows:
        try:
            load_config(config, overrides + row_sets)
        except UserError as exc:
            raise UserError(f"experiment {name}, row '{row_name}': {exc}") from None
    return rows


def run_experiment(name: str, config: str, overrides: list[str], out: str, ranks: int, target: float,
                   only: list[str] | None = None) -> list[dict]:
    if name not in EXPERIMENTS:
        raise UserError(f"unknown experiment '{name}': choose one of {', '.join(EXPERIMENTS)}")
    cfg = load_config(config, overrides, for_command="experiment")  # a bad recipe or path fails before any launch
    target = cfg.report.top1_target if target is None else target  # both in (0, 1]: --target's type, the config's
    rows_to_run = chosen_rows(name, cfg, config, overrides, only)
    os.makedirs(out, exist_ok=True)
    rows = []
    for row_name, row_sets in rows_to_run:
        run_dir = os.path.join(out, "runs", re.sub(r"[^A-Za-z0-9.+-]+", "_", row_name.replace("=", "-")).strip("_"))
        launch_row(config, overrides + row_sets, run_dir, ranks, resolve_engine(cfg.distributed.engine))
        rows.append(summarise_row(row_name, run_dir, target))
    write_json_atomically(os.path.join(out, f"{name}.json"), [{k: v for k, v in r.items() if k != "history"}
                                                              for r in rows])
    print(write_table(name, rows, out))
    plot_rows(name, rows, out)
    return rows
