"""Tensors of any memory layout through element-wise collectives: a channels_last (NHWC) tensor goes as its
dense view, without a copy."""
from __future__ import annotations

import torch


def dense_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(a view of ``t`` that is contiguous in the default sense, the permutation that made it), or (``t``,
    None) when ``t`` is contiguous already. A channels_last (NHWC) tensor is dense in memory but not contiguous
    as NCHW, which Horovod refuses; permuted to N,H,W,C it is contiguous and shares ``t``'s memory, and an
    element-wise collective (all-reduce, broadcast) does not care about the order of the elements."""
    if t.is_contiguous():
        return t, None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    view = t.permute(order)
    if not view.is_contiguous():  # overlapping or gapped storage: no dense view exists
        return t.contiguous(), ()
    return view, order


def undo_dense_view(t: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """The inverse of dense_view: the original shape with the original strides (``order`` () = a copy was made)."""
    if not order:
        return t
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return t.permute(inverse)
