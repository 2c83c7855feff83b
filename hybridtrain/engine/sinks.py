"""What a run shows and sends as it goes besides metrics.jsonl: rank 0's console (``log``, the setup and epoch
lines, the ``ProgressBar``) and the experiment trackers: MLflow (``sinks.mlflow``: a local file store or a tracking
URI) and Weights & Biases (``sinks.wandb``: offline, synced later with ``wandb sync``, or online). Optional
and imported only when asked for (``pip install 'hybridtrain[sinks]'``), on rank 0 only, and fed from the same
records as TensorBoard: ``Board`` stands where TensorBoard's writer stands (``records.RunRecord``), so
every scalar TensorBoard gets (per epoch: losses, accuracies, lr, img/s, the time breakdown, ...) reaches each sink
at the same step; the resolved config goes in as parameters when the run starts, and the report's files (report.md,
report.json, the PNGs) as artifacts when it ends (``log_report``). The trackers' run ids are kept in
run_dir/sinks.json, so ``--resume`` continues the same tracked runs."""
from __future__ import annotations

import json
import os
import re
import sys
import time

from hybridtrain.errors import UserError
from hybridtrain.files import write_text_atomically

# ----------------------------------------------------------------------------- rank 0's console

class ProgressBar:
    """Rank 0's progress through an epoch: tqdm's bar (loss, img/s, ETA) on a terminal; elsewhere (horovodrun
    and batch jobs pipe the output, where each bar update would pile up on one long line) a plain line every
    ``interval_s`` seconds. Reads the device only when it shows something."""

    def __init__(self, total: int, epoch: int, epochs: int, world_size: int, every: int = 5,
                 interval_s: float = 30.0):
        self.total, self.label = total, f"epoch {epoch + 1}/{epochs}"
        self.world_size, self.every, self.interval_s = world_size, every, interval_s
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=self.label, unit="step", leave=False, file=sys.stdout,
                            dynamic_ncols=True)

    def update(self, loss_sum, seen, steps: int) -> None:
        """After a step: ``steps`` of the epoch's ``total`` passes are done; ``loss_sum`` and ``seen`` are its sums
        so far (device tensors, read only for a line or the bar's loss every ``every`` passes)."""
        now = time.perf_counter()
        if self.bar is not None:
            before = self.bar.n
            self.bar.update(steps - before)
            if steps // self.every != before // self.every:
                self.bar.set_postfix(loss=f"{float(loss_sum / seen):.4f}", img_s=f"{self.rate(seen, now):.0f}")
        elif now - self.last_line >= self.interval_s and steps < self.total:
            self.last_line = now
            eta = (now - self.start) * (self.total - steps) / steps
            print(f"hybridtrain: {self.label} step {steps}/{self.total} ({100 * steps / self.total:.0f}%)  "
                  f"loss {float(loss_sum / seen):.4f}  {self.rate(seen, now):.0f} img/s  ETA {eta:.0f}s", flush=True)

    def rate(self, seen, now: float) -> float:
        return float(seen) * self.world_size / (now - self.start)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def log(topo, message: str) -> None:
    if topo.is_root:
        print(message, flush=True)


def device_name(device) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)' or 'cpu'."""
    if device.type != "cuda":
        return str(device)
    import torch  # here: the console's other parts, and the sinks, are torch-free
    return f"{device} ({torch.cuda.get_device_name(device)})"


def epoch_line(r: dict, epochs: int) -> str:
    scale = f"  scale {r['loss_scale']:g}" if r.get("loss_scale", 1.0) != 1.0 else ""
    skipped = f"  skipped {r['skipped_steps']}" if r.get("skipped_steps") else ""
    return (f"epoch {r['epoch']:>3}/{epochs}  train_loss {r['train_loss']:.4f}  val_loss {r['val_loss']:.4f}  "
            f"train_top1 {r['train_top1']:.4f}  top1 {r['val_top1']:.4f}  top5 {r['val_top5']:.4f}  lr {r['lr']:.4g}  "
            f"{r['images_per_sec']:.0f} img/s  {r['epoch_time_s']:.1f}s{scale}{skipped}")


# ----------------------------------------------------------------------------- the trackers

IDS_FILE = "sinks.json"
ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # an MLflow or W&B run id
INSTALL = "pip install 'hybridtrain[sinks]' (or the package alone)"
# how a tracked run ends, by how the training ended: finished, stopped by a SIGTERM (resumable), or failed
MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
WANDB_EXIT_CODE = {"finished": 0, "stopped": 128 + 15, "failed": 1}  # 128 + SIGTERM, as a shell reports it


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """The config as ``section.key -> value`` strings (lists and mappings as JSON)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and prefix == "":
            out.update(flat_params(value, f"{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


def read_ids(run_dir: str) -> dict:
    """The trackers' run ids a resumed run continues ({} when the run had no sinks); one line when the file is not
    what open_sinks wrote (the ids become MLflow's and W&B's folder names: they refuse others, but as a bug's line)."""
    path = os.path.join(run_dir, IDS_FILE)
    if not os.path.lexists(path):
        return {}
    try:
        with open(path) as fh:
            ids = json.load(fh)
        if not isinstance(ids, dict) or not all(name in SINKS and isinstance(run_id, str) and
                                                ID_RE.fullmatch(run_id) for name, run_id in ids.items()):
            raise ValueError("not a tracker name and run id each, such as {\"mlflow\": \"3f2a9c\"}")
        return ids
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is damaged ({exc}): remove it to start new tracked runs, or restore it from a "
                        f"backup") from None


def needed(module: str, key: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UserError(f"{key} is set but {module.split('.')[0]} cannot be imported ({exc}): {INSTALL}, or unset "
                        f"{key}") from None


# MLflow's HTTP client retries a request 7 times with a doubling back-off (minutes) and waits 120 s for each: a
# tracking server that stops answering would hold rank 0, and its peers in the next collective, that long
MLFLOW_HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                      "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PROBE_TIMEOUT_S = 5.0  # a tracking server that does not answer a request in this long is refused before the work


def mlflow_uri(cfg) -> str:
    """The tracking URI sinks.mlflow names ('local': the file store in run_dir/mlruns)."""
    uri = cfg.sinks.mlflow
    return "file:" + os.path.abspath(os.path.join(cfg.run_dir, "mlruns")) if uri == "local" else uri


class MlflowSink:
    def __init__(self, cfg, run_id: str | None):
        for name, value in MLFLOW_HTTP_LIMITS.items():  # read by MLflow at each request: the user's own win
            os.environ.setdefault(name, value)
        mlflow = self.mlflow = needed("mlflow", "sinks.mlflow")
        uri = mlflow_uri(cfg)
        if uri.startswith("file:"):  # MLflow's file store: in maintenance since MLflow 3, and refused unless allowed
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        try:
            mlflow.set_experiment(cfg.sinks.project)
            self.run = mlflow.start_run(run_id=run_id) if run_id else \
                mlflow.start_run(run_name=os.path.basename(os.path.abspath(cfg.run_dir)))
        except mlflow.exceptions.MlflowException as exc:
            message = " ".join(str(exc).split())[:300]
            raise UserError(f"sinks.mlflow={cfg.sinks.mlflow}: MLflow could not start the tracked run ({message}): "
                            f"fix the tracking server or the URI, or unset sinks.mlflow") from None
        self.id = self.run.info.run_id
        if not run_id:
            params = flat_params(cfg.to_dict())
            names = sorted(params)
            for i in range(0, len(names), 100):  # MLflow takes at most 100 parameters a call
                mlflow.log_params({name: params[name][:6000] for name in names[i:i + 100]})

    def log(self, scalars: dict, step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def artifacts(self, paths: list[str]) -> None:
        for path in paths:
            self.mlflow.log_artifact(path)

    def close(self, how: str = "finished") -> None:
        self.mlflow.end_run(status=MLFLOW_STATUS[how])


class WandbSink:
    def __init__(self, cfg, run_id: str | None):
        wandb = self.wandb = needed("wandb", "sinks.wandb")
        name = os.path.basename(os.path.abspath(cfg.run_dir))
        self.run = wandb.init(project=cfg.sinks.project, dir=os.path.abspath(cfg.run_dir), mode=cfg.sinks.wandb,
                              id=run_id, resume="allow" if run_id else None, name=name, reinit="create_new",
                              config=flat_params(cfg.to_dict()) if not run_id else None,
                              settings=wandb.Settings(console="off", save_code=False, disable_git=True,
                                                      x_disable_stats=True))  # the run's records, nothing else
        self.id = self.run.id

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def artifacts(self, paths: list[str]) -> None:
        images = {os.path.basename(p): self.wandb.Image(p) for p in paths if p.endswith(".png")}
        if images:
            self.run.log({f"report/{name}": image for name, image in images.items()})
        artifact = self.wandb.Artifact(f"report-{self.run.id}", type="report")
        for path in paths:
            artifact.add_file(path)
        self.run.log_artifact(artifact)

    def close(self, how: str = "finished") -> None:
        if how == "stopped":
            self.run.mark_preempting()  # with a non-zero exit code: preempted, and resumable (W&B's contract)
        self.run.finish(exit_code=WANDB_EXIT_CODE[how])


SINKS = {"mlflow": MlflowSink, "wandb": WandbSink}


# the tracking URIs whose store is a database: MLflow's SQLAlchemy store, in the full mlflow package only
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
MLFLOW_FORMS = ("local (a file store in run_dir/mlruns), file:/absolute/path, http://host:5000 (a tracking server) or "
                "sqlite:///path/mlflow.db (with the full mlflow package)")


def check_sinks(cfg) -> None:
    """One line on every rank, before torch is imported, when a sink is asked for and its package is missing, when
    MLflow's store needs what mlflow-skinny lacks, or when its tracking server does not answer within
    PROBE_TIMEOUT_S (not minutes later, on rank 0 alone, with its peers waiting in a collective)."""
    import importlib.util
    for name in SINKS:
        if getattr(cfg.sinks, name) and importlib.util.find_spec(name) is None:
            raise UserError(f"sinks.{name} is set but {name} is not installed: {INSTALL}, or unset sinks.{name}")
    uri = cfg.sinks.mlflow
    scheme = uri.split(":", 1)[0].split("+", 1)[0]
    if scheme in DATABASE_SCHEMES and not all(importlib.util.find_spec(m) for m in ("sqlalchemy", "alembic")):
        raise UserError(f"sinks.mlflow={uri} is a database store, which needs the full mlflow package (mlflow-skinny "
                        f"has no SQLAlchemy): pip install mlflow, or use {MLFLOW_FORMS}")
    if scheme in ("http", "https"):
        probe_tracking_server(uri, cfg.sinks.project)


def probe_tracking_server(uri: str, project: str) -> None:
    """One request to the tracking server, the experiment looked up by name: any HTTP answer (an error status
    included: a missing experiment, a login asked for) is an answer; no answer in PROBE_TIMEOUT_S is one line."""
    import urllib.error
    import urllib.parse
    import urllib.request
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode(
        {"experiment_name": project})
    try:
        urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as exc:  # refused, unknown host, timed out, a malformed URL
        reason = getattr(exc, "reason", None) or exc
        raise UserError(f"sinks.mlflow={uri}: the tracking server does not answer ({' '.join(str(reason).split())}, "
                        f"{PROBE_TIMEOUT_S:g} s allowed): start it or fix the URI, or unset sinks.mlflow") from None


def open_sinks(cfg, resumed: bool) -> list:
    """The sinks the config asks for, each continuing its tracked run when ``resumed`` (ids in sinks.json), and
    the ids written for the next resume; [] when none is asked for (nothing imported)."""
    wanted = [name for name in SINKS if getattr(cfg.sinks, name)]
    if not wanted:
        return []
    ids = read_ids(cfg.run_dir) if resumed else {}
    sinks = {name: SINKS[name](cfg, ids.get(name)) for name in wanted}
    os.makedirs(cfg.run_dir, exist_ok=True)
    write_text_atomically(os.path.join(cfg.run_dir, IDS_FILE),
                          json.dumps({name: sink.id for name, sink in sinks.items()}) + "\n")
    return list(sinks.values())


class Board:
    """Where TensorBoard's writer stands (``add_scalar``, ``flush``, ``close``): each scalar to TensorBoard (when
    on) and to every sink, the epoch's scalars sent to a sink together at ``flush``."""

    def __init__(self, writer, sinks: list):
        self.writer, self.sinks, self.pending, self.step = writer, sinks, {}, None

    def add_scalar(self, tag: str, value, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)
        if value is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.step is not None and step != self.step:
                self._send()
            self.pending[tag], self.step = float(value), step

    def _send(self) -> None:
        if self.pending:
            for sink in self.sinks:
                sink.log(self.pending, self.step)
        self.pending = {}

    def flush(self) -> None:
        self._send()
        if self.writer is not None:
            self.writer.flush()

    def close(self, how: str = "finished") -> None:
        self.flush()
        for sink in self.sinks:
            sink.close(how)
        if self.writer is not None:
            self.writer.close()


REPORT_FILES = ("report.md", "report.json", "accuracy.png", "throughput.png", "lr.png", "breakdown.png")


def log_report(cfg) -> None:
    """The report's files to the run's sinks as artifacts (rank 0, after ``hybridtrain train`` wrote the report):
    each sink's tracked run continued from sinks.json, then ended."""
    if not any(getattr(cfg.sinks, name) for name in SINKS):
        return
    paths = [path for path in (os.path.join(cfg.run_dir, name) for name in REPORT_FILES) if os.path.isfile(path)]
    for sink in open_sinks(cfg, resumed=True):
        sink.artifacts(paths)
        sink.close()
