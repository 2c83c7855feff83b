"""Math of the hybrid optimizer: bounds and schedules by hand, kernels against plain NumPy and
plain per-tensor torch loops, optimizer phase switch, resume and Horovod-style rebuild."""

import copy
import math

import numpy as np
import pytest
import torch

from hybridtrain.optim.optimizers import LARS, HybridOptimizer, LinearScalingAdaBound, adabound_step_, lars_sgd_step_
from hybridtrain.optim.schedules import (
    adabound_bounds,
    bound_progress,
    reference_adabound_bounds,
    sgd_decay_lr,
)

INF = math.inf


# ---------------------------------------------------------------- bounds, by hand
# lr = 0.1, N = 2 -> lr*N = 0.2; beta2 = 0.999 -> 1/(1-beta2) = 1000; T = 10 -> 1/((1-b2)T) = 100.

def test_bounds_near_zero_progress_upper_explodes_lower_vanishes():
    lower, upper = adabound_bounds(1e-6, 10, 0.1, 2, 0.999)
    assert upper == pytest.approx(0.2 + 1e9 - 100, rel=1e-12)  # 999,999,900.2
    assert lower == pytest.approx(2e-8, rel=1e-12)  # (1e-6/10) * 0.2


def test_bounds_at_first_epoch():
    lower, upper = adabound_bounds(1, 10, 0.1, 2, 0.999)
    assert upper == pytest.approx(900.2, rel=1e-12)  # 0.2 + 1000 - 100
    assert lower == pytest.approx(0.02, rel=1e-12)  # 0.1 * 0.2


def test_bounds_at_half_warmup():
    lower, upper = adabound_bounds(5, 10, 0.1, 2, 0.999)
    assert upper == pytest.approx(100.2, rel=1e-12)  # 0.2 + 200 - 100
    assert lower == pytest.approx(0.1, rel=1e-12)  # 0.5 * 0.2


@pytest.mark.parametrize("t", [10, 10.0, 12.5, 1000])
def test_bounds_equal_scaled_lr_at_and_after_T(t):
    lower, upper = adabound_bounds(t, 10, 0.1, 2, 0.999)
    assert lower == pytest.approx(0.2, rel=1e-15)
    assert upper == pytest.approx(0.2, rel=1e-15)


def test_upper_bound_never_below_lower_bound_on_a_grid():
    for T in (1, 5, 10, 30):
        for beta2 in (0.0, 0.9, 0.999):
            for lr, n in ((0.1, 1), (0.1, 24), (3.0, 8)):
                for t in np.linspace(1e-4, 1.5 * T, 97):
                    lower, upper = adabound_bounds(float(t), T, lr, n, beta2)
                    assert upper >= lower
                    assert 0 < lower <= lr * n * (1 + 1e-15)


def test_bound_progress_iteration_granularity():
    assert bound_progress(1, 100, "iteration") == pytest.approx(0.01)
    assert bound_progress(50, 100, "iteration") == pytest.approx(0.5)
    assert bound_progress(100, 100, "iteration") == pytest.approx(1.0)
    assert bound_progress(101, 100, "iteration") == pytest.approx(1.01)


def test_bound_progress_epoch_granularity():
    assert bound_progress(1, 100, "epoch") == 1
    assert bound_progress(100, 100, "epoch") == 1
    assert bound_progress(101, 100, "epoch") == 2
    assert bound_progress(250, 100, "epoch") == 3


def test_sgd_decay_from_switch_origin():
    # lr*N = 0.2, kappa = 0.9, T = 10
    assert sgd_decay_lr(10, 10, 0.1, 2, 0.9) == pytest.approx(0.2, rel=1e-12)
    assert sgd_decay_lr(11, 10, 0.1, 2, 0.9, origin="switch") == pytest.approx(0.18, rel=1e-12)
    assert sgd_decay_lr(12, 10, 0.1, 2, 0.9) == pytest.approx(0.162, rel=1e-12)
    assert sgd_decay_lr(20, 10, 0.1, 2, 0.9) == pytest.approx(0.06973568802, rel=1e-10)  # 0.2*0.9^10


def test_sgd_decay_from_zero_origin():
    assert sgd_decay_lr(0, 10, 0.1, 2, 0.9, origin="zero") == pytest.approx(0.2, rel=1e-12)
    assert sgd_decay_lr(1, 10, 0.1, 2, 0.9, origin="zero") == pytest.approx(0.18, rel=1e-12)
    assert sgd_decay_lr(10, 10, 0.1, 2, 0.9, origin="zero") == pytest.approx(0.06973568802, rel=1e-10)
    assert sgd_decay_lr(7, 3, 0.1, 2, 1.0, origin="zero") == pytest.approx(0.2, rel=1e-12)


def test_reference_bounds_by_hand():
    lower, upper = reference_adabound_bounds(1, 0.1, 1e-3)
    assert lower == pytest.approx(0.1 * 0.001 / 1.001, rel=1e-12)  # 0.1*(1 - 1/1.001)
    assert upper == pytest.approx(100.1, rel=1e-12)  # 0.1*(1 + 1000)
    lower, upper = reference_adabound_bounds(1000, 0.1, 1e-3)
    assert lower == pytest.approx(0.05, rel=1e-12)  # 0.1*(1 - 1/2)
    assert upper == pytest.approx(0.2, rel=1e-12)  # 0.1*(1 + 1)


def _optim(**changes):
    """The default config's optim section with ``changes``, past the config's own checks (what a caller other
    than load_config could hand a schedule)."""
    import dataclasses

    from hybridtrain.config import load_config
    return dataclasses.replace(load_config(None, []).optim, **changes)


@pytest.mark.parametrize("name, changes, sizes, match", [
    ("hybrid", {"adabound_epochs": -3}, (2, 10), "T"),
    ("hybrid", {"adabound_epochs": 1.5}, (2, 10), "T"),
    ("hybrid", {"lr": 0.0}, (2, 10), "base_lr"),
    ("hybrid", {}, (0, 10), "world_size"),
    ("hybrid", {}, (2, 0), "iters_per_epoch"),
    ("hybrid", {"betas": [0.9, 1.0]}, (2, 10), "beta2"),
    ("hybrid", {"bound_granularity": "batch"}, (2, 10), "granularity"),
    ("hybrid", {"kappa": 0.0}, (2, 10), "kappa"),
    ("hybrid", {"kappa": 1.1}, (2, 10), "kappa"),
    ("hybrid", {"kappa_origin": "middle"}, (2, 10), "origin"),
    ("adabound", {"adabound_gamma": 0.0}, (2, 10), "gamma"),
    ("adabound", {"lr": -0.1}, (2, 10), "base_lr"),
    ("goyal", {}, (True, 10), "world_size"),
])
def test_schedule_arguments_are_checked_once_when_the_schedule_is_made(name, changes, sizes, match):
    """The formulas run unchecked at every step; create_schedule checks what they assume, once."""
    from types import SimpleNamespace

    from hybridtrain.optim import create_schedule
    cfg = SimpleNamespace(optim=_optim(name=name, **changes), train=SimpleNamespace(epochs=4))
    with pytest.raises(ValueError, match=match):
        create_schedule(cfg, *sizes)


def test_the_formulas_keep_their_domains():
    with pytest.raises(ValueError, match="granularity"):
        bound_progress(1, 100, "batch")
    with pytest.raises(ValueError, match="epoch must be past the AdaBound warmup"):
        sgd_decay_lr(3, 10, 0.1, 2, 0.9, origin="switch")
    with pytest.raises(ValueError, match="origin"):
        sgd_decay_lr(10, 10, 0.1, 2, 0.9, origin="middle")


# ---------------------------------------------------------------- plain NumPy references

def numpy_adabound(p, g, m, v, k, alpha, beta1, beta2, eps, wd, lower, upper):
    g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    step_size = alpha * np.sqrt(1 - beta2**k) / (1 - beta1**k) / (np.sqrt(v) + eps)
    step_size = np.clip(step_size, lower, upper)
    return p - step_size * m, m, v


def numpy_lars(p, g, buf, lr, momentum, wd, eta, eps, mode, apply_lars):
    if apply_lars:
        w_norm, g_norm = np.linalg.norm(p), np.linalg.norm(g)
        if w_norm > 0 and g_norm > 0:
            local_lr = eta * w_norm / (g_norm + wd * w_norm + eps)
            factor = local_lr if mode == "scale" else min(local_lr / lr, 1.0)
        else:
            factor = 1.0
        d = (g + wd * p) * factor
    else:
        d = g
    buf = momentum * buf + d
    return p - lr * buf, buf


def _as_torch(arrays):
    return [torch.from_numpy(a.copy()) for a in arrays]


def _garbage_like(tensors):
    """Scratch for the foreach kernels, full of NaN: a result that read it before writing it would show."""
    return [torch.full_like(t, math.nan) for t in tensors]


# ---------------------------------------------------------------- kernels vs NumPy (float64)

def test_one_adabound_step_matches_numpy():
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,), (2, 3, 2)]
    p = [rng.normal(size=s) for s in shapes]
    g = [1e-3 * rng.normal(size=s) for s in shapes]
    m = [1e-3 * rng.normal(size=s) for s in shapes]  # moment history
    v = [10.0 ** rng.uniform(-8, -3, size=s) for s in shapes]  # spread so step sizes straddle both bounds
    hyper = dict(k=5, alpha=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-4, lower=0.02, upper=0.5)
    want = [numpy_adabound(*args, **hyper) for args in zip(p, g, m, v)]
    step_sizes = [hyper["alpha"] * np.sqrt(1 - 0.999**5) / (1 - 0.9**5) / (np.sqrt(0.999 * vv + 0.001 * gg**2) + 1e-8)
                  for vv, gg in zip(v, g)]
    all_sizes = np.concatenate([s.ravel() for s in step_sizes])
    assert (all_sizes < 0.02).any() and (all_sizes > 0.5).any()  # both clips are exercised
    assert ((all_sizes > 0.02) & (all_sizes < 0.5)).any()  # and the unclipped range

    tp, tg, tm, tv = _as_torch(p), _as_torch(g), _as_torch(m), _as_torch(v)
    adabound_step_(tp, tg, tm, tv, _garbage_like(tp), 5, 1e-3, 0.9, 0.999, 1e-8, 1e-4, 0.02, 0.5)
    for i, (wp, wm, wv) in enumerate(want):
        np.testing.assert_allclose(tp[i].numpy(), wp, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(tm[i].numpy(), wm, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(tv[i].numpy(), wv, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(tg[i].numpy(), g[i])  # gradients untouched


def test_first_adabound_step_unbounded_is_adam_like():
    rng = np.random.default_rng(1)
    p, g = rng.normal(size=7), rng.normal(size=7)
    want_p, _, _ = numpy_adabound(p, g, np.zeros(7), np.zeros(7), 1, 1e-2, 0.9, 0.999, 1e-12, 0.0, 0.0, INF)
    tp, tg = _as_torch([p]), _as_torch([g])
    adabound_step_(tp, tg, [torch.zeros(7, dtype=torch.float64)], [torch.zeros(7, dtype=torch.float64)],
                   _garbage_like(tp), 1, 1e-2, 0.9, 0.999, 1e-12, 0.0, 0.0, INF)
    np.testing.assert_allclose(tp[0].numpy(), want_p, rtol=1e-12)
    np.testing.assert_allclose(p - tp[0].numpy(), 1e-2 * np.sign(g), rtol=1e-8)  # Adam's first step: alpha*sign(g)


@pytest.mark.parametrize("alpha,lower,upper", [(0.0, 0.02, 0.5), (0.0, 0.0, INF), (1e-3, 0.0, 0.0),
                                               (1e-3, 0.3, 0.3)])
def test_adabound_step_at_the_edges_of_its_bounds_matches_numpy(alpha, lower, upper):
    """alpha = 0 makes every step size clip(0, lower, upper) = lower; upper = 0 stops the update; equal bounds
    make it SGD at that rate. The kernel moves the clip onto the denominator, so these are its corner cases."""
    rng = np.random.default_rng(5)
    p, g, m, v = rng.normal(size=6), 1e-3 * rng.normal(size=6), 1e-3 * rng.normal(size=6), 1e-6 * rng.random(6)
    want_p, want_m, want_v = numpy_adabound(p, g, m, v, 3, alpha, 0.9, 0.999, 1e-8, 1e-4, lower, upper)
    tp, tg, tm, tv = _as_torch([p]), _as_torch([g]), _as_torch([m]), _as_torch([v])
    adabound_step_(tp, tg, tm, tv, _garbage_like(tp), 3, alpha, 0.9, 0.999, 1e-8, 1e-4, lower, upper)
    np.testing.assert_allclose(tp[0].numpy(), want_p, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tm[0].numpy(), want_m, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(tv[0].numpy(), want_v, rtol=1e-12, atol=1e-15)


def _lars_case(rng):
    """Tensors chosen so clip mode both clips and keeps, plus zero-norm and excluded tensors."""
    p = [rng.normal(size=(4, 3)),            # ||w||/||g|| large -> LARC clips to 1
         rng.normal(size=(6,)),              # ||w||/||g|| small -> LARC keeps local_lr/lr
         np.zeros((2, 2)),                   # ||w|| = 0 -> factor 1
         rng.normal(size=(3,)),              # ||g|| = 0 -> factor 1 (weight decay only)
         rng.normal(size=(5,))]              # excluded (BN / bias): plain momentum SGD
    g = [1e-3 * rng.normal(size=(4, 3)),
         10.0 * rng.normal(size=(6,)),
         rng.normal(size=(2, 2)),
         np.zeros(3),
         rng.normal(size=(5,))]
    apply = [True, True, True, True, False]
    return p, g, apply


@pytest.mark.parametrize("mode", ["scale", "clip"])
@pytest.mark.parametrize("with_history", [False, True])
def test_one_lars_step_matches_numpy(mode, with_history):
    rng = np.random.default_rng(2)
    p, g, apply = _lars_case(rng)
    bufs = [0.5 * rng.normal(size=a.shape) if with_history else np.zeros(a.shape) for a in p]
    lr, momentum, wd, eta, eps = 0.2, 0.9, 5e-4, 0.02, 1e-8
    if mode == "clip":  # the chosen tensors hit both sides of min(local_lr/lr, 1)
        ratios = [eta * np.linalg.norm(w) / (np.linalg.norm(d) + wd * np.linalg.norm(w)) / lr for w, d in zip(p[:2], g[:2])]
        assert ratios[0] > 1 > ratios[1]
    want = [numpy_lars(*args, lr, momentum, wd, eta, eps, mode, a) for *args, a in zip(p, g, bufs, apply)]

    tp, tg, tb = _as_torch(p), _as_torch(g), _as_torch(bufs)
    lars_sgd_step_(tp, tg, tb, _garbage_like(tp), lr, momentum, wd, eta, eps, mode, apply)
    for i, (wp, wb) in enumerate(want):
        np.testing.assert_allclose(tp[i].numpy(), wp, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(tb[i].numpy(), wb, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(tg[i].numpy(), g[i])
    np.testing.assert_array_equal(tb[4].numpy(), momentum * bufs[4] + g[4])  # excluded: no wd, no LARS


# ---------------------------------------------------------------- kernels vs plain per-tensor loops

def loop_adabound(params, grads, ms, vs, k, alpha, beta1, beta2, eps, wd, lower, upper):
    for p, g, m, v in zip(params, grads, ms, vs):
        g = g + wd * p
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = alpha * math.sqrt(1 - beta2**k) / (1 - beta1**k) / (v.sqrt() + eps)
        p.sub_(step_size.clamp(lower, upper) * m)


def loop_lars(params, grads, bufs, lr, momentum, wd, eta, eps, mode, apply):
    for p, g, b, a in zip(params, grads, bufs, apply):
        if a:
            w_norm, g_norm = p.norm(), g.norm()
            local_lr = eta * w_norm / (g_norm + wd * w_norm + eps)
            if mode == "clip":
                local_lr = torch.clamp(local_lr / lr, max=1.0)
            factor = torch.where((w_norm > 0) & (g_norm > 0), local_lr, torch.ones_like(local_lr))
            d = (g + wd * p) * factor
        else:
            d = g
        b.mul_(momentum).add_(d)
        p.sub_(lr * b)


def _random_lists(seed, n=9):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen)))
              for _ in range(n)]
    make = lambda scale: [scale * torch.randn(s, generator=gen) for s in shapes]  # noqa: E731
    return make(1.0), make(0.1), make(0.05), [t.abs() for t in make(0.01)]


def _clones(tensors):
    return [t.clone() for t in tensors]


def test_adabound_kernel_equals_per_tensor_loop():
    params, grads, ms, vs = _random_lists(3)
    a = [_clones(x) for x in (params, grads, ms, vs)]
    b = [_clones(x) for x in (params, grads, ms, vs)]
    hyper = (4, 1e-3, 0.9, 0.999, 1e-8, 1e-4, 0.005, 0.5)
    adabound_step_(*a, _garbage_like(a[0]), *hyper)
    loop_adabound(*b, *hyper)
    for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["scale", "clip"])
def test_lars_kernel_equals_per_tensor_loop(mode):
    params, grads, bufs, _ = _random_lists(4)
    params[2].zero_()
    grads[5].zero_()
    apply = [i % 4 != 3 for i in range(len(params))]
    a = [_clones(x) for x in (params, grads, bufs)]
    b = [_clones(x) for x in (params, grads, bufs)]
    hyper = (0.5, 0.9, 1e-4, 0.01, 1e-8, mode, apply)
    lars_sgd_step_(*a, _garbage_like(a[0]), *hyper)
    loop_lars(*b, *hyper)
    for x, y in zip(a[0] + a[2], b[0] + b[2]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- optimizers

def _model_params(seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    weights, norm_and_bias = ([torch.randn(shape, generator=gen).to(device).requires_grad_() for shape in shapes]
                              for shapes in (((8, 4), (3, 8)), ((8,), (3,))))
    return weights, norm_and_bias


def _groups(weights, norm_and_bias):
    return [{"params": weights}, {"params": norm_and_bias, "lars": False, "weight_decay": 0.0}]


def _set_grads(params, step):
    """Deterministic gradients depending on the params and the step (like a real loss)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = 0.3 * p.detach() + torch.randn(p.shape, generator=gen).to(p.device)


def _hybrid_schedule(opt, step):
    """Trainer-like schedule: bounds move every step, the phase switches to SGD at step 5."""
    for group in opt.param_groups:
        group["lower_bound"], group["upper_bound"] = adabound_bounds(step / 2, 2, 0.1, 2, 0.999)
        if step >= 5:
            group["phase"] = "sgd"
            group["lr"] = 0.2 * 0.9 ** (step - 5)


def _run(opt, params, steps):
    for step in steps:
        if isinstance(opt, HybridOptimizer):
            _hybrid_schedule(opt, step)
        _set_grads(params, step)
        opt.step()


def test_hybrid_phase_switch_starts_momentum_from_zero():
    weights, others = _model_params()
    opt = HybridOptimizer(_groups(weights, others), lr=0.2, alpha=1e-3, momentum=0.9)
    _run(opt, weights + others, [1, 2])
    assert all("exp_avg" in opt.state[p] and "momentum_buffer" not in opt.state[p] for p in weights + others)

    ref_weights = [p.detach().clone().requires_grad_() for p in weights]
    ref_others = [p.detach().clone().requires_grad_() for p in others]
    ref = LARS(_groups(ref_weights, ref_others), lr=0.2, momentum=0.9)

    for group in opt.param_groups:
        group["phase"] = "sgd"
    _set_grads(weights + others, 3)
    opt.step()
    _set_grads(ref_weights + ref_others, 3)
    ref.step()
    for p, q in zip(weights + others, ref_weights + ref_others):
        state = opt.state[p]
        assert "exp_avg" not in state and "exp_avg_sq" not in state and "adabound_step" not in state
        assert state["step"] == 3
        assert torch.equal(state["momentum_buffer"], ref.state[q]["momentum_buffer"])  # buf = 0*mu + d
        assert torch.equal(p, q)


def test_the_foreach_updates_reuse_one_scratch_buffer_per_param_that_is_never_saved():
    """The eager (foreach) kernels write g + wd*w and the denominators into the optimizer's scratch, not into fresh
    tensors: the same buffers serve every step of both phases, and the state dict never holds them."""
    weights, others = _model_params()
    opt = HybridOptimizer(_groups(weights, others), lr=0.2, alpha=1e-3)
    _run(opt, weights + others, [1])
    buffers = {id(p): opt.scratch[p].data_ptr() for p in weights + others}
    _run(opt, weights + others, [2, 5, 6])  # 5: the switch to SGD + LARS
    assert opt.param_groups[0]["phase"] == "sgd"
    assert {id(p): opt.scratch[p].data_ptr() for p in weights + others} == buffers
    saved = opt.state_dict()
    assert {key for state in saved["state"].values() for key in state} == {"step", "momentum_buffer"}
    assert all(set(group) - {"params"} <= set(opt.defaults) for group in saved["param_groups"])


@pytest.mark.parametrize("lars_mode", ["scale", "clip"])
def test_fused_updates_match_the_foreach_kernels_through_a_phase_switch_without_recompiling(lars_mode):
    """optim.fused: the compiled kernels, with the step size, the bounds and the lr in device tensors, follow the
    foreach kernels to rounding through both phases and the switch; after each phase's first step (which
    compiles one graph per group) the moving bounds and lr never make them recompile. On the GPU when there is one
    (gpu-check runs it there: Triton's kernels, the scalars in device memory)."""
    import torch._dynamo
    weights, others = _model_params(device="cuda" if torch.cuda.is_available() else "cpu")
    fused_weights, fused_others = ([p.detach().clone().requires_grad_() for p in ps] for ps in (weights, others))
    reference = HybridOptimizer(_groups(weights, others), lr=0.2, alpha=1e-2, lars_mode=lars_mode)
    fused = HybridOptimizer(_groups(fused_weights, fused_others), lr=0.2, alpha=1e-2, lars_mode=lars_mode, fused=True)
    for step in range(1, 9):
        with torch._dynamo.config.patch(error_on_recompile=step not in (1, 5)):  # 5: the switch to SGD + LARS
            for opt, params in ((reference, weights + others), (fused, fused_weights + fused_others)):
                _hybrid_schedule(opt, step)
                _set_grads(params, step)
                opt.step()
        assert fused.param_groups[0]["phase"] == ("sgd" if step >= 5 else "adabound")
        torch.testing.assert_close(fused_weights + fused_others, weights + others, rtol=1e-5, atol=1e-6)
    for p, q in zip(weights + others, fused_weights + fused_others):
        torch.testing.assert_close(fused.state[q]["momentum_buffer"], reference.state[p]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_a_checkpoint_resumes_with_this_runs_fused_choice(fused):
    """optim.fused is how the update runs: a state dict saved with the other choice, or before the key existed
    (no "fused" in its groups), loads and keeps this run's choice."""
    weights, others = _model_params()
    saved = HybridOptimizer(_groups(weights, others), lr=0.2, fused=not fused)
    _run(saved, weights + others, [1])
    state = saved.state_dict()
    for group in state["param_groups"]:
        del group["fused"]  # as written before optim.fused existed
    resumed = HybridOptimizer(_groups(weights, others), lr=0.2, fused=fused)
    resumed.load_state_dict(state)
    assert [g["fused"] for g in resumed.param_groups] == [fused, fused]
    if not fused:  # one more step validates the groups (the fused one would compile: covered above)
        _run(resumed, weights + others, [2])


def test_fused_is_refused_where_no_fused_kernel_exists():
    from hybridtrain.config import load_config
    from hybridtrain.errors import UserError
    with pytest.raises(UserError, match="optim.fused applies to the hybrid and adabound optimizers"):
        load_config(None, ["optim.name=goyal", "optim.fused=true"])


def test_config_knows_the_registrys_names_and_flags():
    """config (no torch) keeps optim.name's choices and the flags it checks: they are the registry's."""
    import dataclasses

    from hybridtrain.config import OPTIMIZER_FLAGS, OptimConfig
    from hybridtrain.optim import OPTIMIZERS
    choices = {f.name: f for f in dataclasses.fields(OptimConfig)}["name"].metadata["choices"]
    assert list(choices) == list(OPTIMIZER_FLAGS) == list(OPTIMIZERS)
    assert OPTIMIZER_FLAGS == {name: tuple(flag for flag in ("fusable", "needs_fp32_state") if getattr(spec, flag))
                               for name, spec in OPTIMIZERS.items()}


def test_hyperparameters_are_checked_when_written():
    """A bad value is one ValueError line where it is written: a schedule, checked once at the first and last
    step of each phase (check_schedule, which create_optimizer runs), or a state dict. apply_schedule, at every
    step, does not check."""
    from hybridtrain.optim import OptimizerBundle
    weights, others = _model_params()
    opt = HybridOptimizer(_groups(weights, others), lr=0.2)
    bundle = OptimizerBundle(opt, lambda step: {"phase": "adabound", "lower_bound": 0.5,
                                                "upper_bound": 0.1 if step == 9 else 1.0})
    bundle.check_schedule([0, 5])
    with pytest.raises(ValueError, match=r"upper_bound \(0.1\) must be >= lower_bound \(0.5\)"):
        bundle.check_schedule([0, 9])
    assert opt.param_groups[0]["upper_bound"] == INF  # checking writes nothing
    state = opt.state_dict()
    state["param_groups"][1]["momentum"] = 1.0
    with pytest.raises(ValueError, match="momentum must be in"):
        HybridOptimizer(_groups(weights, others), lr=0.2).load_state_dict(state)


def test_create_optimizer_checks_the_schedule_at_each_phase_edge():
    """phase_edges: the steps where a schedule's values are at their extremes, the hybrid switch's two included."""
    from types import SimpleNamespace

    from hybridtrain.optim.factory import phase_edges
    hybrid = SimpleNamespace(optim=_optim(name="hybrid", adabound_epochs=2), train=SimpleNamespace(epochs=5))
    assert phase_edges(hybrid, 10) == [0, 19, 20, 49]
    goyal = SimpleNamespace(optim=_optim(name="goyal"), train=SimpleNamespace(epochs=5))
    assert phase_edges(goyal, 10) == [0, 49]


def _snapshot(params):
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("make_opt", [
    lambda groups: HybridOptimizer(groups, lr=0.2, alpha=1e-2, lars_mode="clip"),
    lambda groups: LARS(groups, lr=0.3, mode="scale"),
    lambda groups: LinearScalingAdaBound(groups, lr=1e-2, lower_bound=0.01, upper_bound=0.3),
], ids=["hybrid", "lars", "adabound"])
@pytest.mark.parametrize("saved_after", [3, 6], ids=["save-in-adabound", "save-in-sgd"])
def test_state_dict_round_trip_continues_bitwise(make_opt, saved_after):
    weights, others = _model_params()
    params = weights + others
    opt = make_opt(_groups(weights, others))
    _run(opt, params, range(1, saved_after + 1))
    saved_state = copy.deepcopy(opt.state_dict())
    saved_params = _snapshot(params)
    later = range(saved_after + 1, saved_after + 4)
    _run(opt, params, later)  # from step 3 this crosses the hybrid's AdaBound -> SGD switch (step 5)

    new_weights, new_others = _model_params(seed=99)
    new_params = new_weights + new_others
    with torch.no_grad():
        for p, saved in zip(new_params, saved_params):
            p.copy_(saved)
    resumed = make_opt([{"params": new_weights}, {"params": new_others}])  # defaults differ: load restores groups
    resumed.load_state_dict(copy.deepcopy(saved_state))
    _run(resumed, new_params, later)

    for p, q in zip(params, new_params):
        assert torch.equal(p, q)
    for g_old, g_new in zip(opt.param_groups, resumed.param_groups):
        assert {k: v for k, v in g_old.items() if k != "params"} == {k: v for k, v in g_new.items() if k != "params"}


def _horovod_style_rebuild(opt):
    """Mimic horovod.torch.DistributedOptimizer: a subclass rebuilt from ``param_groups`` only."""
    base = opt.__class__

    def __init__(self, params, named_parameters=None):
        super(self.__class__, self).__init__(params)

    def step(self, closure=None):
        return super(self.__class__, self).step(closure)

    cls = type(base.__name__, (base,), {"__init__": __init__, "step": step})
    return cls([dict(group) for group in opt.param_groups])  # copies: nothing shared with ``opt``


@pytest.mark.parametrize("make_opt", [
    lambda groups: HybridOptimizer(groups, lr=0.7, alpha=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=5e-5,
                                   momentum=0.8, trust_coefficient=0.02, lars_mode="clip", lower_bound=0.01,
                                   upper_bound=9.0, phase="sgd"),
    lambda groups: LARS(groups, lr=0.7, momentum=0.8, weight_decay=5e-5, trust_coefficient=0.02, eps=1e-6, mode="clip"),
    lambda groups: LinearScalingAdaBound(groups, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=5e-5,
                                         lower_bound=0.01, upper_bound=9.0),
], ids=["hybrid", "lars", "adabound"])
def test_rebuild_from_param_groups_keeps_hyperparameters(make_opt):
    weights, others = _model_params()
    original = make_opt(_groups(weights, others))
    rebuilt = _horovod_style_rebuild(original)
    assert isinstance(rebuilt, type(original))
    for g_orig, g_new in zip(original.param_groups, rebuilt.param_groups):
        assert g_new is not g_orig
        assert g_new == g_orig  # same params, same hyperparameters (not the class defaults)

    twin_weights, twin_others = [p.detach().clone().requires_grad_() for p in weights], \
        [p.detach().clone().requires_grad_() for p in others]
    twin = make_opt(_groups(twin_weights, twin_others))
    _set_grads(weights + others, 1)
    rebuilt.step()
    _set_grads(twin_weights + twin_others, 1)
    twin.step()
    for p, q in zip(weights + others, twin_weights + twin_others):
        assert torch.equal(p, q)


@pytest.mark.parametrize("make, match", [
    (lambda p: LARS(p, trust_coefficient=-0.001), "trust_coefficient"),
    (lambda p: LARS(p, mode="trust"), "mode"),
    (lambda p: LARS(p, lr=-0.1), "lr"),
    (lambda p: LARS(p, momentum=1.0), "momentum"),
    (lambda p: LARS([{"params": p, "lars": "no"}]), "lars"),
    (lambda p: LinearScalingAdaBound(p, betas=(1.0, 0.999)), r"betas\[0\]"),
    (lambda p: LinearScalingAdaBound(p, betas=(0.9, -0.1)), r"betas\[1\]"),
    (lambda p: LinearScalingAdaBound(p, betas=(0.9,)), "betas"),
    (lambda p: LinearScalingAdaBound(p, eps=-1e-8), "eps"),
    (lambda p: LinearScalingAdaBound(p, weight_decay=-1e-4), "weight_decay"),
    (lambda p: LinearScalingAdaBound(p, lower_bound=0.5, upper_bound=0.1), "upper_bound"),
    (lambda p: LinearScalingAdaBound(p, lower_bound=-0.1), "lower_bound"),
    (lambda p: HybridOptimizer(p, phase="adam"), "phase"),
    (lambda p: HybridOptimizer(p, lars_mode="scaled"), "lars_mode"),
    (lambda p: HybridOptimizer(p, trust_coefficient=-1.0), "trust_coefficient"),
    (lambda p: HybridOptimizer(p, alpha=-1e-3), "alpha"),
    (lambda p: HybridOptimizer(p, betas=(0.9, 1.5)), "betas"),
])
def test_optimizers_reject_bad_arguments(make, match):
    weights, _ = _model_params()
    with pytest.raises(ValueError, match=match):
        make(weights)


def test_bad_phase_set_by_trainer_is_rejected_at_step():
    weights, _ = _model_params()
    opt = HybridOptimizer(weights)
    opt.param_groups[0]["phase"] = "warmup"
    _set_grads(weights, 1)
    with pytest.raises(ValueError, match="phase must be one of"):
        opt.step()
