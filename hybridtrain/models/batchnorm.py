"""BatchNorm across ranks (Lu et al. 2020, §2.2.3 item 1) and the switches of its Table 3.4 ablation.

The paper's strategy, the default:
- per-rank statistics in training: no communication in the forward pass, a fixed per-rank batch;
- running statistics = those of the last training iteration (momentum 1), not a moving average;
- before every validation and checkpoint, the running mean and variance are averaged over all ranks by a
  all-reduce in FP32, after which every rank holds bitwise-identical buffers.

``bn.combine: pooled`` replaces the plain average of the variances by the exact pooled variance of the
union of the ranks' last batches (m_r values per channel on rank r, M = sum_r m_r; PyTorch's running_var
s_r^2 is unbiased, i.e. divided by m_r - 1):

    mu = sum_r m_r mu_r / M
    s^2 = (sum_r (m_r - 1) s_r^2 + sum_r m_r (mu_r - mu)^2) / (M - 1)

i.e. the mean of the (biased) variances plus the variance of the means, times M / (M - 1) so that it is
unbiased like PyTorch's own running_var. With a moving average the per-rank estimates span many batches
and m_r is the last batch's, so there it is a pooled combination of estimates rather than an exact one.

``bn.sync`` computes the statistics over all ranks in every forward pass: the engine's SyncBatchNorm on GPUs;
those refuse CPU tensors, so on CPUs :class:`CrossRankBatchNorm` does the same with a
differentiable all-reduce of per-channel sums.
"""
from __future__ import annotations

import torch
from torch import nn

from hybridtrain.distributed import collectives as distributed


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def running_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every BN's running mean and running variance, in module order."""
    return [buf for bn in batch_norms(model) for buf in (bn.running_mean, bn.running_var)]


def record_count(bn: nn.Module, inputs: tuple) -> None:
    """Forward pre-hook: values per channel of the latest training batch (m_r of the pooled variance)."""
    if bn.training:
        x = inputs[0]
        bn.last_count = x.numel() // x.shape[1]


def configure_batch_norm(model: nn.Module, bn_cfg, device: torch.device) -> nn.Module:
    """Apply ``bn.sync``, ``bn.stats``/``bn.momentum`` and (for ``pooled``) the count hooks; returns the model."""
    if bn_cfg.sync:
        model = convert_to_cross_rank(model, device)
    for bn in batch_norms(model):
        # PyTorch's convention, running = (1 - m) running + m batch: m = 1 keeps the last iteration's statistics
        bn.momentum = 1.0 if bn_cfg.stats == "last_iteration" else bn_cfg.momentum
        if bn_cfg.combine == "pooled" and not bn_cfg.sync:  # synced statistics are global: the mean keeps them
            bn.register_forward_pre_hook(record_count)
    return model


# ----------------------------------------------------------------------------- averaging over ranks

@torch.no_grad()
def average_running_statistics(model: nn.Module, combine: str = "mean") -> None:
    """Running mean/var over all ranks in FP32, whatever the buffers' dtype; afterwards equal on every rank."""
    bns = batch_norms(model)
    if not bns:
        return
    if combine == "pooled" and all(getattr(bn, "last_count", 0) > 0 for bn in bns):
        means, variances = pooled_statistics(bns)
    else:
        averaged = distributed.allreduce_mean_fp32([bn.running_mean for bn in bns] +
                                                   [bn.running_var for bn in bns], "bn_statistics")
        means, variances = averaged[:len(bns)], averaged[len(bns):]  # mean_r over ranks, in FP32 (paper 2.2.3)
    for bn, mean, var in zip(bns, means, variances):
        bn.running_mean.copy_(mean.view_as(bn.running_mean))
        bn.running_var.copy_(var.view_as(bn.running_var))


def pooled_statistics(bns: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The exact pooled mean and unbiased variance (module docstring), in two FP32 sum all-reduces."""
    counts = [float(bn.last_count) for bn in bns]
    sizes = [bn.running_mean.numel() for bn in bns]
    device = bns[0].running_mean.device
    weighted = [m * bn.running_mean.float() for m, bn in zip(counts, bns)]
    local = torch.cat(weighted + [torch.tensor(counts, device=device)])
    total = distributed.allreduce_sum(local, "bn_pooled_means")
    grand = total[-len(bns):]  # M per layer
    means = [s / big_m for s, big_m in zip(torch.split(total[:-len(bns)], sizes), grand)]  # mu = sum m_r mu_r / M
    spread = torch.cat([(m - 1) * bn.running_var.float() + m * (bn.running_mean.float() - mu) ** 2
                        for m, bn, mu in zip(counts, bns, means)])
    sums = torch.split(distributed.allreduce_sum(spread, "bn_pooled_variances"), sizes)
    variances = [s / (big_m - 1) for s, big_m in zip(sums, grand)]  # (sum (m_r-1) s_r^2 + m_r (mu_r-mu)^2) / (M-1)
    return means, variances


# ----------------------------------------------------------------------------- cross-rank statistics

class CrossRankBatchNorm(nn.BatchNorm2d):
    """BatchNorm over the union of all ranks' batches, for CPUs (the engines' SyncBatchNorm needs CUDA).

    Each forward pass all-reduces per-channel sums (sum x, sum x^2, count) with the engine's differentiable
    all-reduce, so both the normalisation and the gradients are those of the global batch.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or distributed.size() == 1:
            return super().forward(x)
        xf, c = x.float(), x.shape[1]
        dims = [0] + list(range(2, x.ndim))
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims), xf.new_full((1,), x.numel() // c)])
        total = distributed.allreduce_differentiable(local)
        count = total[2 * c]
        mean = total[:c] / count
        var = (total[c:2 * c] / count - mean * mean).clamp_min(0.0)  # biased: E[x^2] - E[x]^2
        self.update_running(mean.detach(), var.detach() * count / (count - 1))
        shape = (1, c) + (1,) * (x.ndim - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.float().view(shape) + self.bias.float().view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        m = self.momentum
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased_var.to(self.running_var.dtype), alpha=m)
        self.num_batches_tracked += 1


def convert_to_cross_rank(module: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm2d replaced by the cross-rank class, with its parameters and buffers."""
    cls = distributed.sync_batch_norm_class() if device.type == "cuda" else CrossRankBatchNorm
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, cls):
            synced = cls(child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats)
            synced.load_state_dict(child.state_dict())
            setattr(module, name, synced.to(device=child.weight.device, dtype=child.weight.dtype))
        else:
            convert_to_cross_rank(child, device)
    return module
