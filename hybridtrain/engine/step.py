"""The training step, ``train_step``: zero the gradients, forward and scaled backward of each micro-batch, the
update, or on overflow no update and the BN running statistics put back (``RunningStatsGuard``, which also keeps a
CUDA graph's warm-up passes out of them); and its opt-in speed-ups: ``train.compile`` and ``train.cuda_graphs``.

``train.compile``: ``torch.compile`` (inductor, default mode) of the model for the training step only; the
checkpoints, the optimizer, Horovod and evaluation keep the plain module, which shares its parameters, so the
state-dict keys do not change and evaluation does not trigger a second compilation. The first steps compile.
``train.compile_scope: blocks`` (the default) compiles each residual block apart: AOTAutograd makes a compiled
region one autograd node, so with the whole model compiled every gradient hook Horovod registers fires at the end
of the backward (the first hook at 90% of it on the CPU), while block by block a block's
gradients start their all-reduce as soon as its backward is done (``python -m benchmarks.probes.hook_timing``).

Progressive resizing (``data.res_*``) trains at a few resolutions: compiled, each is its own static-shape graph
(``dynamic=False``: one recompile per resolution, counted in tests/test_progressive.py, not one dynamic-shape graph
for all), the recompile limit raised to hold them; graphed, each resolution has its own capture (``GraphedSteps``).

``train.cuda_graphs``: forward, FP32 loss and scaled backward are captured once in a CUDA graph on static
input tensors and replayed every step, following PyTorch's whole-network recipe: a few warmup iterations on
a side stream, the gradients set to None before capture so that the graph allocates them in its private
pool, each batch copied into the static inputs before replay. The optimizer step is not captured; it runs
eagerly after each replay (PyTorch's documented choice for AMP: "capture forward, loss, and backward but not
the optimizer step"), because
- the schedule sets lr, AdaBound's bounds and the phase as Python numbers every step, which a graph would
  freeze at their capture values;
- loss scaling decides on the host whether to skip the step (one read of the overflow flag);
- Horovod's all-reduce runs on its background thread and cannot be captured.
Under Horovod the graph is captured before ``DistributedOptimizer`` registers its gradient hooks, so no hook
fires during a replay and ``synchronize()`` all-reduces every gradient after the backward (one fused
all-reduce, no overlap with the backward). Horovod re-points each ``p.grad`` at its all-reduce output;
``GraphedStep`` points them back at the graph's memory after every step.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from hybridtrain.data.resolution import resolutions
from hybridtrain.errors import UserError
from hybridtrain.models.batchnorm import batch_norms, running_buffers
from hybridtrain.models.resnet import ResidualBlock
from hybridtrain.optim import optimizer_spec
from hybridtrain.precision.scaler import Precision

# torch.cuda.graph's keywords for the capture. "thread_local": only this thread's unsafe CUDA calls invalidate the
# capture; torch's default "global" also fails it on another thread's, such as the DataLoader's pin-memory thread
# pinning a batch (cuMemHostAlloc, cudaEventQuery) while the graph is captured.
CAPTURE_OPTIONS = {"capture_error_mode": "thread_local"}


def compiles_in_epoch(epoch: int, first_epoch_of_process: bool, optim_cfg) -> bool:
    """Whether the epoch's first steps compile or capture: a process's first epoch (torch.compile, CUDA graphs,
    cuDNN autotuning), and the optimizer's `Spec.fused_switch_epoch` (optim.fused compiles the next phase)."""
    return first_epoch_of_process or epoch == optimizer_spec(optim_cfg).fused_switch_epoch(optim_cfg)


def recompiles_in_epoch(cfg, epoch: int) -> bool:
    """train.compile under progressive resizing (data.res_*): an epoch at a resolution no earlier epoch had compiles
    its graphs for it in its first steps."""
    schedule = resolutions(cfg.data)
    return cfg.train.compile and epoch > 0 and schedule(epoch) not in schedule.distinct(epoch)


def warmup_steps(compiles: bool, updates_per_epoch: int, steps: int = 3) -> int:
    """The steps of an epoch timed apart as warmup: its first ``steps`` when it compiles (`compiles_in_epoch`)
    and has at least twice as many; else none."""
    return steps if compiles and updates_per_epoch >= 2 * steps else 0


class RunningStatsGuard:
    """Every BN's running statistics as they were before a step, put back when the step is skipped: a batch with
    a NaN must not poison them (with a moving average it would never wash out)."""

    def __init__(self, model: torch.nn.Module):
        counters = [bn.num_batches_tracked for bn in batch_norms(model) if bn.num_batches_tracked is not None]
        # one list per dtype for the foreach copies: the statistics, and the int64 batch counters (a CUDA graph's
        # warm-up passes must not leave them ahead of eager's)
        self.groups = [group for group in (running_buffers(model), counters) if group]
        self.saved = [[buf.clone() for buf in group] for group in self.groups]

    def save(self) -> None:
        for saved, group in zip(self.saved, self.groups):
            torch._foreach_copy_(saved, group)

    def restore(self) -> None:
        for saved, group in zip(self.saved, self.groups):
            torch._foreach_copy_(group, saved)


class GraphedStep:
    """The training step with forward, loss and backward replayed from one CUDA graph (see the module doc).

    ``backward_pass`` as EagerStep', returning the graph's static (loss, logits), valid until the next replay;
    ``train_step(graphed, ...)`` is the whole step.
    """

    WARMUP_ITERATIONS = 3  # on a side stream before capture (PyTorch's recipe; cudnn autotuning, lazy state)

    def __init__(self, model, precision, static_images: torch.Tensor, static_labels: torch.Tensor, loss_fn):
        self.static_images, self.static_labels, self.loss_fn = static_images, static_labels, loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graph, self.capture_stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        statistics = RunningStatsGuard(model)  # the warm-up's passes on the static batch must not reach them
        self._warm_up(model, precision)
        self._drop_grads()  # the graph allocates the gradients from its pool: replays write them there
        with torch.cuda.graph(self.graph, stream=self.capture_stream, **CAPTURE_OPTIONS):  # the warmup's stream
            self.static_loss, self.static_logits = self._forward_backward(model, precision)
        # the graph's gradient memory, to point p.grad back at after each step: zero_grad sets p.grad to None, and
        # Horovod's synchronize() grad.set_()s it to its all-reduce output, which is this memory itself when the
        # wire is FP32 (no compression); an FP16 wire would re-point the storage of these very tensors, so graphs
        # refuse it (distributed/horovod.py: check_graphs_and_compression)
        self.static_grads = [p.grad.detach() for p in self.params]
        statistics.restore()  # a capture records the BN updates without running them: only the warm-up's go

    def _forward_backward(self, model, precision) -> tuple[torch.Tensor, torch.Tensor]:
        with precision.forward_context(self.static_images.device):
            logits = model(self.static_images)
        loss = self.loss_fn(logits, self.static_labels)
        precision.scaler.backward(loss)
        return loss.detach(), logits.detach()

    def _warm_up(self, model, precision) -> None:
        """A few eager iterations on the side stream the capture will use, off the default stream."""
        self.capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.capture_stream):
            for _ in range(self.WARMUP_ITERATIONS):
                self._drop_grads()
                self._forward_backward(model, precision)
        torch.cuda.current_stream().wait_stream(self.capture_stream)

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def backward_pass(self, precision, images: torch.Tensor, labels: torch.Tensor, weight: float = 1.0,
                      sync: bool = True):
        """Copy the batch in and replay forward, loss and backward; the gradients are the graph's (weight 1:
        config validation keeps accumulation and random per-rank batches away from graphs)."""
        if images.shape != self.static_images.shape:
            raise UserError(f"train.cuda_graphs replays one batch shape {tuple(self.static_images.shape)} but got "
                            f"{tuple(images.shape)}: keep every training batch full (train.batch_size) or set "
                            f"train.cuda_graphs=false")
        self.static_images.copy_(images, non_blocking=True)  # a no-op when the caller passes the static batch
        self.static_labels.copy_(labels, non_blocking=True)
        self.graph.replay()
        for p, grad in zip(self.params, self.static_grads):  # undo zero_grad's None (see static_grads)
            p.grad = grad
        return self.static_loss, self.static_logits

class GraphedSteps:
    """One ``GraphedStep`` per training batch shape: progressive resizing captures each resolution of the run before
    the first step (before Horovod's hooks exist, as one capture is), each in its own memory pool, and a step replays
    its batch's capture."""

    def __init__(self, captures: list[GraphedStep]):
        self.captures = {tuple(c.static_images.shape): c for c in captures}

    def backward_pass(self, precision, images: torch.Tensor, labels: torch.Tensor, weight: float = 1.0,
                      sync: bool = True):
        capture = self.captures.get(tuple(images.shape))
        if capture is None:
            raise UserError(f"train.cuda_graphs captured the batch shapes {', '.join(map(str, self.captures))} but got "
                            f"{tuple(images.shape)}: keep every training batch full (train.batch_size) or set "
                            f"train.cuda_graphs=false")
        return capture.backward_pass(precision, images, labels, weight, sync)


def static_batch(cfg, device: torch.device, dtype: torch.dtype, size: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero images and labels of the training batch's shape (``size`` px, default data.crop_size), dtype and
    layout: the graph's inputs."""
    b, size = cfg.train.batch_size, size or cfg.data.crop_size
    memory_format = torch.channels_last if cfg.data.channels_last else torch.contiguous_format
    images = torch.zeros(b, 3, size, size, dtype=dtype, device=device).contiguous(memory_format=memory_format)
    return images, torch.zeros(b, dtype=torch.long, device=device)


def build_step(model, cfg, precision, batch: tuple[torch.Tensor, torch.Tensor] | None = None, wrap=None):
    """Forward and backward as train.compile and train.cuda_graphs ask: ``.backward_pass(precision, images,
    labels, weight, sync) -> (loss, logits)``.

    Call it before Horovod wraps the optimizer (a graph must be captured without its hooks). ``batch``: the
    static inputs to capture on; default zeros of the config's batch shape. ``wrap``: the engine's wrapper of
    the forward (collectives.wrap_model: DDP, or none), put around the compiled blocks, or inside the compiled
    model (torch.compile of DDP is the order PyTorch's DDP optimizer splits at bucket boundaries).
    """
    wrap = wrap or (lambda m: m)
    schedule = resolutions(cfg.data)
    sizes = schedule.distinct(cfg.train.epochs) if batch is None else [batch[0].shape[-1]]
    # progressive resizing: a static-shape graph per resolution (not torch's automatic dynamic shapes after the
    # first change); random per-rank batches change the batch size every step and keep torch's default
    dynamic = False if schedule.progressive and cfg.bn.per_rank_batch == "fixed" else None
    if not cfg.train.compile:
        forward_model = wrap(model)
    elif cfg.train.compile_scope == "model":
        forward_model = torch.compile(wrap(model), dynamic=dynamic)
        raise_recompile_limit(len(sizes) + 1)  # a graph per resolution, and eval mode's
    else:
        forward_model = wrap(compile_blocks(model, dynamic=dynamic, resolutions=len(sizes)))
    # the loss, made once: the next loss option changes this line, not the steps
    loss_fn = partial(classification_loss, label_smoothing=cfg.train.label_smoothing)
    if not cfg.train.cuda_graphs:
        return EagerStep(forward_model, loss_fn)
    if batch is not None:
        return GraphedStep(forward_model, precision, *batch, loss_fn)
    device = next(model.parameters()).device
    captures = [GraphedStep(forward_model, precision, *static_batch(cfg, device, precision.policy.input_dtype, size),
                            loss_fn) for size in sizes]
    return captures[0] if len(captures) == 1 else GraphedSteps(captures)


def build_train_step(model, cfg, precision, batch: tuple[torch.Tensor, torch.Tensor] | None = None, ema=None):
    """``step(optimizer, precision, micro_batches) -> StepResult``: ``train_step`` as the config runs it (``ema``:
    the weights' EMA, updated after every applied step)."""
    return partial(train_step, build_step(model, cfg, precision, batch), ema=ema)


def compiled_forward(model: torch.nn.Module, scope: str) -> torch.nn.Module:
    """``model`` as train.compile runs it: one compiled graph (``model``) or one per residual block (``blocks``)."""
    return torch.compile(model) if scope == "model" else compile_blocks(model)


def raise_recompile_limit(graphs: int) -> None:
    """Let dynamo keep ``graphs`` graphs per code object (``cache_size_limit``: see ``compile_blocks``)."""
    import torch._dynamo  # only where compiling (it is slow to import)

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, graphs)


def compile_blocks(module: torch.nn.Module, backend: str = "inductor", dynamic: bool | None = None,
                   resolutions: int = 1) -> torch.nn.Module:
    """A copy of the containers on the way to each residual block, with every block ``torch.compile``'d. Blocks,
    parameters, buffers and the other layers stay the original's (``model.train()``/``.eval()`` reach them and the
    state-dict keys do not change); a compiled block is one autograd node of the backward.

    Dynamo keeps at most ``recompile_limit`` (8) graphs per code object, and the blocks of a class share their
    forward's: ResNet-50's 16 blocks have 8 shapes, twice over with validation's eval mode, and past the limit
    dynamo runs the rest eagerly with only a warning. So the limit is raised to two graphs per block
    (``cache_size_limit`` is its name on torch 2.3 and an alias of it on newer releases), and to
    one more per block for each further training resolution (``resolutions``: progressive resizing; ``dynamic``:
    torch.compile's, False there: one static-shape graph per resolution)."""
    blocks = sum(isinstance(m, ResidualBlock) for m in module.modules())
    raise_recompile_limit((1 + resolutions) * blocks)
    return _compile_each_block(module, backend, dynamic)


def _compile_each_block(module: torch.nn.Module, backend: str, dynamic: bool | None = None) -> torch.nn.Module:
    if isinstance(module, ResidualBlock):
        return torch.compile(module, backend=backend, dynamic=dynamic)
    if not any(isinstance(m, ResidualBlock) for m in module.modules()):
        return module
    container = copy.copy(module)
    container._modules = {name: _compile_each_block(child, backend, dynamic)
                          for name, child in module._modules.items()}
    return container


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                        label_smoothing: float = 0.0) -> torch.Tensor:
    """Softmax cross-entropy in FP32 (FP64 in fp64 mode) whatever the compute dtype (paper 2.2.2, item 2);
    ``label_smoothing`` e (train.label_smoothing): the target is (1 - e) on the label plus e/C on each of the C
    classes, so the loss is (1 - e) * CE(label) + e * mean over classes of -log p."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, reduction=reduction,
                           label_smoothing=label_smoothing)


def backward_pass(model, precision: Precision, images, labels, weight: float = 1.0,
                  sync: bool = True, loss_fn=classification_loss) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (in the policy's precision), FP32 loss (``loss_fn``), scaled and weighted backward; gradients
    accumulate.
    ``sync`` False: a pass of gradient accumulation before the last, whose gradients a DDP ``model`` keeps local
    (its ``no_sync``); Horovod counts the passes itself (backward_passes_per_step)."""
    no_sync = getattr(model, "no_sync", None)
    with contextlib.nullcontext() if sync or no_sync is None else no_sync(), \
            precision.forward_context(images.device):
        logits = model(images)
    loss = loss_fn(logits, labels)
    precision.scaler.backward(loss * weight if weight != 1.0 else loss)
    return loss.detach(), logits.detach()


@dataclass
class StepResult:
    """What one optimizer step returns, for the epoch's bookkeeping: each pass's (loss, logits, labels), detached
    (a GraphedStep's are its static tensors, valid until its next replay), and whether the update ran."""
    passes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    stepped: bool  # False: a gradient was not finite; the update was skipped and the BN statistics put back

    @property
    def loss(self) -> torch.Tensor:
        """The last pass's loss."""
        return self.passes[-1][0]

    @property
    def logits(self) -> torch.Tensor:
        """The last pass's logits."""
        return self.passes[-1][1]


def train_step(step, optimizer, precision: Precision, micro_batches: Sequence, bn_guard=None,
               ema=None, clock=None) -> StepResult:
    """One optimizer step however ``step`` runs forward and backward (EagerStep, compiled, or GraphedStep), as
    ``train``, ``bench``, ``scale`` and the tests run it: zero the gradients; a forward and scaled backward of each
    ``(images, labels, weight)`` in ``micro_batches``, already on the device (the gradients accumulate; Horovod
    all-reduces once, as its backward_passes_per_step says); unscale; the update unless the gradients overflowed,
    in which case ``bn_guard`` (a RunningStatsGuard) puts back the BN running statistics the skipped passes changed.
    The update's overflow check reads the device, so the passes have read every batch when this returns. ``ema``
    (engine.ema.WeightEMA): updated after an applied update only (device ops, no host sync). ``clock``
    (breakdown.StepClock): marks the engine's ``synchronize()``, the wait for the all-reduce the backward left."""
    optimizer.zero_grad()  # as the engine's gradient memory needs (wrap_optimizer: DDP's bucket views in place)
    if bn_guard is not None:
        bn_guard.save()
    passes = []
    for j, (images, labels, weight) in enumerate(micro_batches):
        loss, logits = step.backward_pass(precision, images, labels, weight, sync=j == len(micro_batches) - 1)
        passes.append((loss, logits, labels))
    if clock is not None:
        clock.mark("sync_begin")
    optimizer.synchronize()  # the all-reduce of the (scaled) gradients that the backward left (Horovod's; DDP: none)
    if clock is not None:
        clock.mark("sync_end")
    stepped = precision.scaler.step(optimizer)  # unscale, the update (not synchronizing again), S
    if not stepped and bn_guard is not None:
        bn_guard.restore()
    if stepped and ema is not None:
        ema.update()
    return StepResult(passes, stepped)


class EagerStep:
    """Forward and backward passes of ``model`` (compiled or not), run as written."""

    def __init__(self, model, loss_fn=classification_loss):
        self.model, self.loss_fn = model, loss_fn

    def backward_pass(self, precision: Precision, images, labels, weight: float = 1.0, sync: bool = True):
        return backward_pass(self.model, precision, images, labels, weight, sync, self.loss_fn)
