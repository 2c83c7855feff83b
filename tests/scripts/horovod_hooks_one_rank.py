"""One process, Horovod's gradient hooks forced on: the path a 2+ rank job's step takes (hooks,
LayoutCompressor, synchronize, the scaler's unscale) on a node with one device, which Horovod alone would skip
(it registers no hooks at size 1). Runs on the GPU when there is one (NCCL), else on the CPU.

usage: horovod_hooks_one_rank.py OUT.json

For each case, three loss-scaled SGD steps of ResNet-18 through Horovod's DistributedOptimizer, against the
same steps of the plain optimizer with each gradient rounded as the wire rounds it (none: unchanged; fp16: cast
to FP16 and back, which is what an average over one rank leaves). Writes, per case, whether the losses and the
parameters are bitwise equal, and whether each parameter's gradient kept its layout.
"""
import json
import sys

import torch

from benchmarks.step_bench import synthetic_batch
from hybridtrain.config import load_config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed.engines import with_step_contract
from hybridtrain.engine.step import build_train_step
from hybridtrain.models import create_model
from hybridtrain.optim import apply_schedule, create_optimizer
from hybridtrain.precision.policy import prepare_model, set_fp32_math
from hybridtrain.precision.scaler import create_precision

# FP32 compute with the demo's loss scaling (what the FP16 wire needs): the hooks, the wire and the scaler are
# what is checked, and the CPU's FP16 convolutions would only make it slow
SMALL = ["model.arch=resnet18", "model.num_classes=10", "train.batch_size=4", "data.crop_size=32",
         "optim.name=sgd", "precision.mode=fp32", "precision.loss_scaling=dynamic", "precision.loss_scale=1024"]


def train(sets: list[str], device: torch.device, horovod: bool):
    cfg = load_config(None, SMALL + sets)
    set_fp32_math(cfg.precision.tf32)
    precision = create_precision(cfg.precision)
    policy = precision.policy
    model = prepare_model(create_model("resnet18", 10, seed=0).to(device), policy)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    bundle = create_optimizer(model, cfg, 1, 10)
    images, labels = synthetic_batch(cfg, device, policy.input_dtype, 10)
    step = build_train_step(model, cfg, precision, (images, labels))
    wire = cfg.distributed.compression
    if horovod:
        bundle.optimizer = distributed.wrap_optimizer(bundle.optimizer, model, cfg, 1, wire)
        bundle.optimizer._register_hooks()  # what Horovod does on 2+ ranks or under --elastic
    else:  # the plain optimizer, with the step contract's no-op synchronize()
        bundle.optimizer = with_step_contract(bundle.optimizer)
        for p in model.parameters() if wire == "fp16" else ():
            p.register_hook(lambda g: g.half().to(g.dtype))
    losses, layouts_kept = [], True
    for i in range(3):
        apply_schedule(bundle.optimizer, bundle.schedule, i)
        loss = step(bundle.optimizer, precision, [(images, labels, 1.0)]).loss
        losses.append(float(loss))
        layouts_kept &= all(p.grad is None or p.grad.stride() == p.stride() for p in model.parameters())
    return losses, [p.detach().cpu().clone() for p in model.parameters()], layouts_kept


def main() -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    distributed.init(device=device.type, engine="horovod")
    results = {}
    for wire in ("none", "fp16"):
        for channels_last in (False, True):
            sets = [f"distributed.compression={wire}", f"data.channels_last={str(channels_last).lower()}"]
            plain_losses, plain_params, _ = train(sets, device, horovod=False)
            hvd_losses, hvd_params, layouts_kept = train(sets, device, horovod=True)
            results[f"{wire}/{'nhwc' if channels_last else 'nchw'}"] = {
                "losses": hvd_losses, "same_losses": hvd_losses == plain_losses,
                "same_params": all(torch.equal(a, b) for a, b in zip(plain_params, hvd_params)),
                "layouts_kept": layouts_kept}
    with open(sys.argv[1], "w") as fh:
        json.dump({"device": device.type, "results": results}, fh)


if __name__ == "__main__":
    main()
