"""``train --profile`` (the ``profile`` section): torch.profiler over a window of steps on every rank, counted from
the process's first step: ``wait`` steps, ``warmup`` steps profiled and thrown away, ``active`` steps recorded,
written as a Chrome/Perfetto trace per rank, ``run_dir/profile/trace-rank<r>.json`` (open it in ui.perfetto.dev or
chrome://tracing). On a GPU, ``profile.memory`` also records a CUDA memory snapshot with Python stacks over the
recorded steps, ``memory-rank<r>.pickle`` (pytorch.org/memory_viz). Off (the default), nothing is imported or
started: the epoch asks one attribute per step (Trainer.profiler). The static and the elastic loop start it once
per process, after the run folder is claimed (``step_profiler``)."""
from __future__ import annotations

import os

import torch


def step_profiler(cfg, topo) -> StepProfiler | None:
    """This rank's profiler when train --profile asks for one, else None."""
    return StepProfiler(cfg.profile, cfg.run_dir, topo.rank, topo.device) if cfg.profile.enabled else None


class StepProfiler:
    """The window's profiler for one rank: ``step()`` after every training step, ``close()`` at the run's end (a run
    shorter than the window writes what it recorded)."""

    def __init__(self, p, run_dir: str, rank: int, device: torch.device):
        from torch.profiler import ProfilerActivity, profile, schedule
        self.folder, self.rank = os.path.join(run_dir, "profile"), rank
        os.makedirs(self.folder, exist_ok=True)
        self.cuda = device.type == "cuda"
        self.memory = p.memory and self.cuda
        self.record_from, self.end = p.wait + p.warmup, p.wait + p.warmup + p.active
        self.done = 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities,
                            on_trace_ready=lambda prof: prof.export_chrome_trace(self.path("trace", "json")),
                            schedule=schedule(wait=p.wait, warmup=p.warmup, active=p.active, repeat=1))
        self.prof.start()
        self.maybe_record_memory()

    def path(self, kind: str, ext: str) -> str:
        return os.path.join(self.folder, f"{kind}-rank{self.rank}.{ext}")

    def maybe_record_memory(self) -> None:
        if self.memory and self.done == self.record_from:
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")

    def step(self) -> None:
        if self.prof is None:
            return
        self.done += 1
        self.prof.step()
        self.maybe_record_memory()
        if self.done >= self.end:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        self.prof.stop()
        self.prof = None
        if self.memory and self.done > self.record_from:
            torch.cuda.memory._dump_snapshot(self.path("memory", "pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
