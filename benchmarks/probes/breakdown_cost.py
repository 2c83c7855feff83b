"""What the time breakdown (engine/breakdown.py) costs the training step: bench's trainer step on one synthetic
batch, run with and without the breakdown's marks in turn (off, on, off, on, ...: a drift of the machine's speed
falls on both alike), each step timed with the device synchronised; the median step time of each, their ratio, and
the host syncs per step of each (the breakdown adds none: on a GPU its marks are CUDA events, read without a host sync).

    python -m benchmarks.probes.breakdown_cost --config configs/demo.yaml --steps 60 [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.host_syncs import count_host_syncs
from benchmarks.step_bench import alternated_steps, job_of_one, synchronize, trainer_loop
from hybridtrain.config import load_config
from hybridtrain.engine.breakdown import StepClock


def breakdown_cost(config: str | None, sets: list[str], steps: int, warmup: int, threads: int) -> dict:
    """{'off_ms', 'on_ms' (medians), 'ratio' (on / off), 'host_syncs_off', 'host_syncs_on', 'parts_s'}."""
    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(config, sets)
    with job_of_one():
        step, device, _, _ = trainer_loop(cfg)
        clock = StepClock(device)  # not attached: a job of one reduces nothing in the backward

        def marked():
            clock.mark("begin")
            clock.mark("drawn")  # the bench's batch is on the device already
            step(clock)
            clock.mark("end")
        for _ in range(max(1, warmup)):
            step()
            marked()
        synchronize(device)
        times = alternated_steps({"off": step, "on": marked}, steps, device)
        syncs = {label: count_host_syncs(fn, device) for label, fn in (("off", step), ("on", marked))}
        parts = clock.totals()
    off, on = (1000 * statistics.median(times[label]) for label in ("off", "on"))
    return {"device": str(device), "steps": steps, "off_ms": off, "on_ms": on, "ratio": on / off,
            "host_syncs_off": syncs["off"], "host_syncs_on": syncs["on"], "parts_s": parts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.breakdown_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="recipe YAML (default: the built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each (default 60)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each first (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    r = breakdown_cost(args.config, args.set, args.steps, args.warmup, args.threads)
    print(f"{r['device']}: {r['steps']} steps each, alternated; median step {r['off_ms']:.2f} ms without the "
          f"breakdown, {r['on_ms']:.2f} ms with it (ratio {r['ratio']:.3f}); host syncs per step "
          f"{r['host_syncs_off']} / {r['host_syncs_on']}")


if __name__ == "__main__":
    main()
