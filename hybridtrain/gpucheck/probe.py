"""gpu-check's child process: what the check needs to know of this machine before any row, in one JSON line.

    python -m hybridtrain.gpucheck.probe

{"gpus", "name", "cc_list", "torch", "cuda", "dali", "checks": {precision: [refusal or "", [warnings]]}, "reason"}:
the GPUs' compute capabilities as Horovod's build takes them ("90"); the node
checks (hybridtrain.hardware.checks.check_node) per precision the rows train in; ``reason`` says why torch cannot
use a GPU when it has none (a driver too old for torch's CUDA first: review 3 #5).
"""
from __future__ import annotations

import importlib.util
import json

from hybridtrain.gpucheck.rows import PRECISIONS


def no_gpu_reason(torch_cuda: str, driver_api: int, unusable: str) -> str:
    """Why a torch sees no GPU: its CUDA build against the driver's (cuDriverGetVersion), else torch's own words."""
    from hybridtrain.hardware.checks import driver_refusal
    return driver_refusal(driver_api, torch_cuda) or unusable


def dali_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:  # no nvidia namespace at all
        return False


def probe() -> dict:
    import torch

    from hybridtrain.distributed.topology import cuda_unusable_reason
    from hybridtrain.errors import UserError
    from hybridtrain.hardware.checks import check_node
    from hybridtrain.hardware.gpus import driver_api_version
    found = {"gpus": 0, "name": "", "cc_list": "", "torch": torch.__version__, "cuda": torch.version.cuda or "",
             "dali": dali_installed(), "checks": {}, "reason": ""}
    if not torch.cuda.is_available():
        found["reason"] = no_gpu_reason(found["cuda"], driver_api_version() if found["cuda"] else 0,
                                        cuda_unusable_reason())
        return found
    found["gpus"], found["name"] = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    found["cc_list"] = ",".join(sorted({"%d%d" % torch.cuda.get_device_capability(i) for i in range(found["gpus"])}))
    for precision in PRECISIONS:
        try:
            found["checks"][precision] = ["", check_node(torch.device("cuda", 0), precision)]
        except UserError as exc:
            found["checks"][precision] = [str(exc), []]
    return found


if __name__ == "__main__":
    print(json.dumps(probe()))
