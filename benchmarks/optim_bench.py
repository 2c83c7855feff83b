"""``python -m benchmarks bench-optim``: the optimizer step alone, per phase of the recipe, against ``torch.optim.SGD``.

The CPU proxy of the optimizer's share of a step. The recipe's model (ResNet-50's parameter shapes by default) gets
fixed random gradients; then ``steps`` timed calls of ``optimizer.step()`` follow, each after the schedule for that
step has been applied, as in training. The rows are:
- ``sgd-foreach``: ``torch.optim.SGD(momentum, weight_decay, foreach=True)``, the reference a PyTorch user would write;
- ``hybrid/adabound``: the hybrid optimizer in its AdaBound warmup phase (the paper's bounds B_l, B_u, 2.2.1);
- ``hybrid/sgd+lars``: the hybrid optimizer after the switch, SGD at lr*N*kappa^epoch with LARS;
- with ``--fused``, both again with ``optim.fused`` (compiled kernels; the warmup steps compile them).
Each row gives the median and p90 ms per step and its ratio to ``sgd-foreach``.
"""
from __future__ import annotations

import statistics

import torch

from benchmarks.step_bench import bench_device, optimizer_label, synthetic_classes, timed_steps
from hybridtrain.config import load_config
from hybridtrain.models import model_from_config
from hybridtrain.optim import apply_schedule, create_optimizer, optimizer_spec
from hybridtrain.optim.schedules import hybrid_phase_start
from hybridtrain.reports import markdown_table

ITERS_PER_EPOCH = 100  # the schedule's epoch length: the AdaBound rows run at steps 0.., the LARS rows after T


def fixed_gradients(model: torch.nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (1e-3 * torch.randn(p.shape, generator=generator)).to(p.device, p.dtype)


def row(name: str, seconds: list[float], parameters: int) -> dict:
    times = [1000 * t for t in seconds]
    return {"optimizer": name, "median_ms": statistics.median(times),
            "p90_ms": statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0],
            "parameters": parameters}


def bench_optimizer(config: str | None, overrides: list[str], steps: int, warmup: int, threads: int,
                    fused: bool = False) -> list[dict]:
    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(config, list(overrides) + ["optim.name=hybrid"])  # validated: 1 <= T < train.epochs
    device = bench_device()
    model = model_from_config(cfg.model, synthetic_classes(cfg), seed=cfg.seed).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    fixed_gradients(model)
    o = cfg.optim
    reference = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                                foreach=True)
    rows = [row("sgd-foreach", timed_steps(reference.step, steps, warmup, device, "sgd-foreach"), parameters)]
    variants = [(phase, optimizer_label(cfg, phase), cfg) for phase in optimizer_spec(cfg.optim).phases]
    if fused:
        fused_cfg = load_config(config, list(overrides) + ["optim.name=hybrid", "optim.fused=true"])
        variants += [(phase, f"{name} fused", fused_cfg) for phase, name, _ in variants]
    for phase, name, variant in variants:
        bundle = create_optimizer(model, variant, world_size=1, iters_per_epoch=ITERS_PER_EPOCH)
        start = hybrid_phase_start(phase, cfg.optim.adabound_epochs, ITERS_PER_EPOCH)
        scheduled = iter(range(start, start + warmup + steps))

        def step(bundle=bundle, scheduled=scheduled):
            apply_schedule(bundle.optimizer, bundle.schedule, next(scheduled))
            bundle.optimizer.step()
        rows.append(row(name, timed_steps(step, steps, warmup, device, name), parameters))
        assert bundle.optimizer.param_groups[0]["phase"] == phase  # the rows time the phase they name
    for r in rows:
        r.update(arch=cfg.model.arch, device=str(device), ratio_to_sgd=r["median_ms"] / rows[0]["median_ms"],
                 threads=torch.get_num_threads())
    return rows


def format_table(rows: list[dict]) -> str:
    header = ["optimizer", "arch", "parameters", "device", "threads", "median ms", "p90 ms", "÷ sgd-foreach"]
    return markdown_table(header, [[r["optimizer"], r["arch"], f"{r['parameters']:,}", r["device"], r["threads"],
                                    f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}", f"{r['ratio_to_sgd']:.3f}"]
                                   for r in rows])
