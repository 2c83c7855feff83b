"""Where a run's time goes, measured in every run: each epoch split into waiting for input, forward + backward,
exposed communication, the optimizer step, validation, checkpointing and the rest, per rank and over the ranks;
and the time to the first step, split into the set-up's parts.

What each part is (per rank; the epoch's record holds the mean over the ranks and, on 2+ ranks, each rank's):

- ``input``: from the start of a step to its batches on the device (the loader's ``next``, the host-to-device copy;
  the epoch's first batch, its workers' start-up, included);
- ``compute``: forward and backward of the step's passes, less the communication inside the backward (below);
- ``communication``: the wait for the gradient all-reduce that the backward did not hide. Horovod: the time in the
  wrapped optimizer's ``synchronize()``, which ``step.train_step`` calls and marks (its hooks start the all-reduces
  during the backward; ``synchronize()`` waits for what is left). DDP (the torch engine): the time from the moment
  the first parameter's gradient is computed, the backward's last (the stem's convolution: the backward runs from
  the classifier back to it), to the end of ``backward()``, which DDP holds until every bucket is all-reduced. A
  rank whose peers are slower waits here too: a straggler shows as its peers' communication;
- ``optimizer``: the rest of the update (unscale and the finite check, the optimizer's step);
- ``validation``, ``checkpoint``: the end-of-epoch validation and the checkpoint's write (rank 0 writes, the other
  ranks wait for it in validation's all-reduce);
- ``other``: the rest of the epoch's wall time (the progress bar, the audit, BN averaging, the record).

On the CPU each mark is ``time.perf_counter()``. On a GPU each mark records a CUDA event on the current stream (no
host sync); once more than 64 steps are pending, those the GPU has finished are folded in (``query`` and
``elapsed_time``, neither blocks), the rest at the epoch's end (one ``synchronize`` of the last event): the parts
are then the GPU's view, e.g. ``input`` is how long the GPU waited for the batch to arrive, ``communication`` how
long it waited for the host to leave ``synchronize()``.

The slowest rank is the one with the most time in its own work (input + compute + optimizer): the rank its peers
wait for in communication. Records hold ``breakdown_s`` (the mean over ranks), ``breakdown_per_rank_s``,
``slowest_rank``, ``dominant`` (the part with the most time) and, in the first record of a process, ``startup_s``.
"""
from __future__ import annotations

import time

STEP_PARTS = ("input", "compute", "communication", "optimizer")
PARTS = (*STEP_PARTS, "validation", "checkpoint", "other")
LABELS = {"input": "waiting for input", "compute": "forward + backward", "communication": "exposed communication",
          "optimizer": "optimizer step", "validation": "validation", "checkpoint": "checkpointing", "other": "other"}

# the step's marks, in order: begin (the step starts), drawn (its batches on the device), sync_begin and sync_end
# (around the engine's synchronize(), marked by step.train_step), end (the update done); grad_ready: the first
# parameter's gradient (DDP)


class StepClock:
    """One epoch's step marks for one rank (see the module doc): ``mark(name)`` from the epoch and the step;
    ``attach(model)``, when the engine reduces in the backward, marks the first parameter's gradient too (a tensor
    hook, removed by ``detach()``); ``totals()`` the seconds per part, read once."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.sums = dict.fromkeys(STEP_PARTS, 0.0)
        self.now: dict = {}
        self.steps: list = []  # CUDA: one dict of events per step, read in totals()
        self.in_backward = False
        self.hook = None  # the first parameter's gradient hook (DDP), while attached

    def _stamp(self):
        if self.cuda:
            import torch
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, name: str) -> None:
        self.now[name] = self._stamp()
        if name == "end":
            if "sync_end" in self.now and "drawn" in self.now and "begin" in self.now:
                if self.cuda:
                    self.steps.append(self.now)
                    if len(self.steps) > 64:  # fold the steps the GPU has finished: a query, not a sync
                        while self.steps and self.steps[0]["end"].query():
                            self._add(self.steps.pop(0), lambda a, b: a.elapsed_time(b) / 1000)
                else:
                    self._add(self.now, lambda a, b: b - a)
            self.now = {}

    def add(self, part: str, seconds: float) -> None:
        """Host time spent on ``part`` outside the steps (the loader's restart at the epoch's start: input)."""
        self.sums[part] += seconds

    def _add(self, m: dict, span) -> None:
        sums = self.sums
        sums["input"] += span(m["begin"], m["drawn"])
        in_backward = 0.0
        if self.in_backward and "grad_ready" in m:  # DDP: the wait at the backward's end, after the last gradient
            in_backward = max(0.0, span(m["grad_ready"], m["sync_begin"]))
        sums["compute"] += span(m["drawn"], m["sync_begin"]) - in_backward
        sums["communication"] += span(m["sync_begin"], m["sync_end"]) + in_backward
        sums["optimizer"] += span(m["sync_end"], m["end"])

    def totals(self) -> dict:
        """Seconds per step part over the epoch's steps so far (CUDA: the events read now, once)."""
        if self.cuda and self.steps:
            self.steps[-1]["end"].synchronize()
            for m in self.steps:
                self._add(m, lambda a, b: a.elapsed_time(b) / 1000)
            self.steps = []
        return dict(self.sums)

    def attach(self, model, in_backward: bool) -> None:
        """``in_backward``: the engine reduces in the backward (DDP), so the first parameter's gradient is marked
        (a tensor hook on it until ``detach()``)."""
        self.detach()
        self.in_backward = in_backward
        first = next((p for p in model.parameters() if p.requires_grad), None) if in_backward else None
        self.hook = first.register_hook(self._grad_ready) if first is not None else None

    def detach(self) -> None:
        if self.hook is not None:
            self.hook, hook = None, self.hook
            hook.remove()

    def _grad_ready(self, grad):
        self.now["grad_ready"] = self._stamp()


def reduces_in_backward(step) -> bool:
    """True when the step's forward model all-reduces inside the backward (DDP: it has ``no_sync``)."""
    return getattr(getattr(step, "model", None), "no_sync", None) is not None


# ----------------------------------------------------------------------------- the epoch's figures

def epoch_fields(allgather, steps: dict, validation_s: float, checkpoint_s: float, epoch_start: float, size: int,
                 tag: str) -> dict:
    """The record's breakdown fields from this rank's ``steps`` (StepClock.totals) and its end-of-epoch times:
    every rank's parts gathered once (``allgather``: the engine's allgather_floats), the mean over the ranks, each
    rank's on 2+ ranks, the slowest rank and the dominant part. ``other`` is the rest of the epoch's wall time from
    ``epoch_start`` (a ``perf_counter``) to after the gather, for every rank (they leave the gather together)."""
    measured = PARTS[:-1]
    mine = {**{part: steps.get(part, 0.0) for part in STEP_PARTS}, "validation": validation_s,
            "checkpoint": checkpoint_s}
    flat = allgather([mine[part] for part in measured], f"breakdown.{tag}")
    epoch_time = time.perf_counter() - epoch_start
    per_rank = {part: [flat[r * len(measured) + i] for r in range(size)] for i, part in enumerate(measured)}
    per_rank["other"] = [max(0.0, epoch_time - sum(per_rank[part][r] for part in measured)) for r in range(size)]
    mean = {part: sum(values) / size for part, values in per_rank.items()}
    fields = {"breakdown_s": mean, "dominant": dominant_part(mean)}
    if size > 1:
        own_work = [sum(per_rank[part][r] for part in ("input", "compute", "optimizer")) for r in range(size)]
        slowest = max(range(size), key=own_work.__getitem__)
        fields.update(breakdown_per_rank_s=per_rank, slowest_rank=slowest,
                      dominant_per_rank=[dominant_part({p: per_rank[p][r] for p in PARTS}) for r in range(size)])
    return fields


def dominant_part(parts: dict) -> str:
    return max(PARTS, key=lambda part: parts.get(part, 0.0))


def shares_line(parts: dict) -> str:
    """'compute 61%, input 20%, ...' (largest first; parts under 1% left out)."""
    total = sum(parts.values()) or 1.0
    ordered = sorted(((v, p) for p, v in parts.items() if p in PARTS), reverse=True)
    return ", ".join(f"{p} {100 * v / total:.0f}%" for v, p in ordered if v / total >= 0.01)


# ----------------------------------------------------------------------------- time to the first step

STARTUP_PARTS = ("imports", "engine_start", "data_scan", "model_build", "loader_start", "run_setup", "first_step")
_startup: dict = {"marks": [], "reported": False}


def startup_mark(name: str) -> None:
    """The end of set-up part ``name`` (STARTUP_PARTS), now; each part runs from the mark before it. None after the
    first step: an elastic reset's set-up again is training time, not the start-up's."""
    marks = _startup["marks"]
    if not any(mark == "first_step" for mark, _ in marks):
        marks.append((name, time.perf_counter()))


def startup_fields() -> dict:
    """Once per process, after its first step: ``{"startup_s": {part: s, ..., "total": s}}`` from the process's
    start (the imports: the interpreter, the config, torch and the engine's library); {} after."""
    if _startup["reported"] or not _startup["marks"]:
        return {}
    _startup["reported"] = True
    import psutil  # here: the report reads PARTS without it
    started = psutil.Process().create_time()  # the process's start as wall-clock time (Linux: from /proc)
    now_wall, now = time.time(), time.perf_counter()
    begin = now - (now_wall - started)
    parts, before = {}, begin
    for name, at in _startup["marks"]:
        parts[name] = parts.get(name, 0.0) + max(0.0, at - before)
        before = at
    parts["total"] = before - begin
    return {"startup_s": parts}


def first_step_done() -> None:
    """After every step: the first of the process ends the set-up's time (``first_step``)."""
    marks = _startup["marks"]
    if marks and marks[-1][0] != "first_step" and not _startup["reported"]:
        startup_mark("first_step")


def startup_line(parts: dict) -> str:
    return (f"hybridtrain: first step {parts['total']:.1f} s after the process started ("
            + ", ".join(f"{name.replace('_', ' ')} {parts[name]:.1f}" for name in STARTUP_PARTS if name in parts)
            + ")")
