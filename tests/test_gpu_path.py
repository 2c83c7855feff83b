"""The GPU path, checked where the CPU can check it: NHWC tensors through Horovod's compressors and broadcast,
rank -> device binding, the compression each precision mode gets, IEEE FP32, memory budgets, OOM forms, warmup
left out of S1, and a bug in one rank reported in one line (real horovodrun ranks for the collectives)."""
from __future__ import annotations

import inspect
import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import HOROVODRUN, REPO, rank_output, run

from benchmarks.max_batch import is_out_of_memory, memory_budget_mb
from hybridtrain.config import gradient_compression, load_config
from hybridtrain.distributed import horovod, topology
from hybridtrain.engine import step
from hybridtrain.engine.step import compiles_in_epoch, warmup_steps
from hybridtrain.errors import UserError
from hybridtrain.hardware import checks as hardware_checks
from hybridtrain.precision.policy import resolve_policy, set_fp32_math
from hybridtrain.reports.report import run_speed

SCRIPT = os.path.join(REPO, "tests", "scripts", "channels_last_collectives.py")


def nhwc(*shape: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=generator, dtype=dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("shape", [(64, 64, 3, 3), (64, 3, 7, 7), (256, 64, 1, 1), (8, 3, 5, 4)])
def test_the_dense_view_of_an_nhwc_tensor_shares_its_memory_and_is_contiguous(shape):
    t = nhwc(*shape)
    view, order = horovod.dense_view(t)
    assert view.is_contiguous() and view.data_ptr() == t.data_ptr()
    back = horovod.undo_dense_view(view, order)
    assert back.shape == t.shape and back.stride() == t.stride() and back.data_ptr() == t.data_ptr()
    # the view's element order is memory order: N, H, W, C for NHWC
    expected = t.numpy().transpose(0, 2, 3, 1) if order else t.numpy()
    np.testing.assert_array_equal(view.numpy().reshape(expected.shape), expected)


def test_no_compression_hands_horovod_the_gradients_own_memory_and_gives_back_its_strides():
    grad = nhwc(64, 64, 3, 3)
    sent, ctx = horovod.NoCompression.compress(grad)
    assert sent.is_contiguous() and sent.data_ptr() == grad.data_ptr()  # no layout copy
    sent.mul_(2)  # what an in-place all-reduce does
    back = horovod.NoCompression.decompress(sent, ctx)
    assert back.stride() == grad.stride() and back.data_ptr() == grad.data_ptr()


def test_fp16_compression_casts_once_and_returns_fp32_with_the_nhwc_strides():
    grad = nhwc(64, 3, 7, 7) * 1e-3
    sent, ctx = horovod.FP16Compression.compress(grad)
    assert sent.dtype == torch.float16 and sent.is_contiguous()
    back = horovod.FP16Compression.decompress(sent, ctx)
    assert back.dtype == torch.float32 and back.stride() == grad.stride()
    expected = grad.numpy().astype(np.float16).astype(np.float32)  # NumPy's own round-to-nearest FP16
    np.testing.assert_array_equal(back.numpy(), expected)


def test_a_contiguous_gradient_passes_through_untouched():
    grad = torch.randn(1000, 512)
    sent, ctx = horovod.NoCompression.compress(grad)
    assert sent is grad and horovod.NoCompression.decompress(sent, ctx) is grad


@pytest.mark.parametrize("mode,extra,expected", [
    ("fp32", [], "none"),
    ("fp32", ["precision.loss_scaling=dynamic"], "fp16"),  # the paper's P40 scheme: FP32 compute, FP16 wire
    ("fp64", [], "none"),
    ("mixed", ["precision.compute_dtype=fp16"], "fp16"),
    ("mixed", ["precision.compute_dtype=bf16"], "none"),
    ("layered", [], "fp16"),
    ("fp16_pure", ["optim.name=goyal"], "fp16"),
])
def test_auto_compression_is_fp16_exactly_where_the_loss_is_scaled(mode, extra, expected):
    cfg = load_config(None, [f"precision.mode={mode}", *extra])
    assert gradient_compression("auto", cfg.precision) == expected


@pytest.mark.parametrize("sets,needle", [
    (["precision.mode=fp32", "distributed.compression=fp16"], "needs loss scaling"),
    (["precision.mode=mixed", "precision.compute_dtype=bf16", "distributed.compression=fp16"], "needs loss scaling"),
    (["precision.mode=fp64", "precision.loss_scaling=dynamic", "distributed.compression=fp16"], "fp64 gradients"),
])
def test_fp16_compression_of_unscaled_or_fp64_gradients_is_refused_in_one_line(sets, needle):
    with pytest.raises(UserError, match=needle) as caught:
        load_config(None, sets)
    assert "\n" not in str(caught.value) and "distributed.compression" in str(caught.value)


def test_every_recipe_sends_fp16_only_scaled_gradients():
    for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
        cfg = load_config(os.path.join(REPO, "configs", name))
        policy = resolve_policy(cfg.precision)
        if gradient_compression(cfg.distributed.compression, cfg.precision) == "fp16":
            assert policy.loss_scaling != "none", name


def test_fp32_math_is_ieee_unless_tf32_is_asked_for():
    """On every torch from the oldest supported (no per-op settings before 2.9) to the pin, and with the legacy
    getters that inductor reads still answering (a per-op write alone makes them raise on 2.13)."""
    per_op = hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")
    try:
        for tf32 in (False, True):
            assert set_fp32_math(tf32) == ("tf32" if tf32 else "ieee")
            assert torch.backends.cudnn.allow_tf32 is tf32
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
            assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
            if per_op:
                assert torch.backends.cudnn.conv.fp32_precision == ("tf32" if tf32 else "ieee")
                assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
    finally:
        set_fp32_math(False)


@pytest.mark.parametrize("local_rank,visible,expected", [(0, 8, 0), (5, 8, 5), (5, 1, 0), (3, 2, 1)])
def test_a_rank_takes_its_own_gpu_or_the_one_it_sees(local_rank, visible, expected):
    assert topology.device_index(local_rank, visible) == expected


def test_ranks_sharing_one_gpu_are_found_per_host():
    peers = (("a", 1, "GPU-1"), ("a", 2, "GPU-2"), ("b", 3, "GPU-1"), ("b", 4, "GPU-1"), ("c", 5, ""), ("c", 6, ""))
    assert topology.shared_gpus(peers) == [[2, 3]]  # host a's GPU-1 and host b's GPU-1 are different GPUs
    assert topology.shared_gpus(peers[:2]) == []


@pytest.mark.parametrize("affinity,node,local_size,expected", [
    (64, 64, 8, 8),  # all the node's cores, 8 ranks: a share each
    (8, 64, 8, 8),   # srun --cpus-per-task=8 bound the rank already: all 8 are its own
    (2, 2, 2, 1),
    (1, 64, 8, 1),
])
def test_thread_counts_follow_the_ranks_own_affinity(affinity, node, local_size, expected):
    assert topology.rank_cores(affinity, node, local_size) == expected


def test_device_cpu_stays_on_the_cpu():
    assert topology.select_device("cpu", 3) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal when CUDA is unusable")
def test_device_cuda_without_a_usable_gpu_is_one_line_saying_why():
    with pytest.raises(UserError) as caught:
        topology.select_device("cuda", 0)
    text = str(caught.value)
    assert "CUDA is unusable" in text and "train.device=cpu" in text and "\n" not in text


def test_the_max_batch_budget_keeps_the_margin_and_the_training_headroom():
    assert memory_budget_mb(81559, 0.05) == pytest.approx(81559 * 0.95 - 3072)
    assert memory_budget_mb(1000, 0.0, headroom_mb=100) == 900


@pytest.mark.parametrize("message,oom", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
    ("CUDA error: operation not permitted when stream is capturing", True),
    ("Expected all tensors to be on the same device", False),
])
def test_every_form_of_a_gpu_allocation_failure_counts_as_out_of_memory(message, oom):
    assert is_out_of_memory(RuntimeError(message)) is oom


def test_a_process_first_epoch_keeps_its_warmup_apart_from_s1():
    assert warmup_steps(True, 100) == 3 and warmup_steps(False, 100) == 0 and warmup_steps(True, 5) == 0
    # optim.fused compiles the SGD + LARS kernel at the hybrid's switch, epoch T (0-based): timed apart there too
    fused = load_config(None, ["optim.fused=true", "optim.adabound_epochs=3"])
    assert [compiles_in_epoch(e, False, fused.optim) for e in range(5)] == [False, False, False, True, False]
    assert not compiles_in_epoch(3, False, load_config(None, ["optim.adabound_epochs=3"]).optim)
    assert compiles_in_epoch(4, True, fused.optim)  # a resumed process's first epoch
    # 1,000 images in 10 s, of which 100 in the 6 s of compilation: 900 / 4 = 225 img/s, not 100
    history = [{"samples_seen": 1000, "train_time_s": 10.0, "warmup_samples": 100, "warmup_time_s": 6.0},
               {"samples_seen": 1000, "train_time_s": 4.0}]  # an older record: no warmup keys
    assert run_speed(history) == pytest.approx(1900 / 8.0)


def test_nhwc_broadcast_and_gradient_allreduce_on_two_ranks(tmp_path):
    """Real ranks: broadcast_model and DistributedOptimizer's hooks on NHWC conv weights and gradients, with
    each compressor; the averaged gradient equals NumPy's mean of both ranks' gradients."""
    out = tmp_path / "out"
    proc = run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", _python(), SCRIPT, str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in ("none", "fp16"):
        a, b = results[0][name], results[1][name]
        assert a["grad_strides"] == a["param_strides"], "the gradient keeps the NHWC strides"
        assert a["grad"] == b["grad"]
        local = [np.array(x["local_grad"], dtype=np.float32) for x in (a, b)]
        if name == "fp16":  # each rank's gradient rounded to FP16, summed in FP16, halved (exact for a power of 2)
            mean = ((local[0].astype(np.float16) + local[1].astype(np.float16)) / np.float16(2)).astype(np.float32)
        else:
            mean = (local[0] + local[1]) / np.float32(2)
        np.testing.assert_allclose(np.array(a["grad"], dtype=np.float32), mean, rtol=1e-6, atol=0)
    assert results[0]["broadcast"] == results[1]["broadcast"]


def _python() -> str:
    import sys
    return sys.executable


def test_a_bug_in_one_rank_is_one_line_naming_it_with_the_traceback_in_a_log(tmp_path):
    script = os.path.join(REPO, "tests", "scripts", "bug_in_one_rank.py")
    proc = run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", _python(), script, str(tmp_path)], timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [x for x in output.splitlines() if "unexpected" in x]
    assert len(lines) == 1 and "rank 1: unexpected ZeroDivisionError" in lines[0], output[-3000:]
    log = tmp_path / "logs" / "rank-1-error.log"
    assert str(log) in lines[0] and "Traceback" in log.read_text() and "ZeroDivisionError" in log.read_text()
    assert "Traceback" not in rank_output(output)


def test_cuda_graphs_with_a_compressed_wire_on_several_horovod_ranks_is_one_line():
    """Horovod's hooks (registered at 2+ ranks) decompress FP16 gradients into new tensors set as
    p.grad, which a replayed graph never writes again; refused. One rank (no hooks) and no compression stay."""
    with pytest.raises(UserError, match=r"cuda_graphs with fp16 gradient compression on 2 Horovod ranks.*"
                                        r"distributed.compression=none, or train.cuda_graphs=false"):
        horovod.check_graphs_and_compression(True, "fp16", 2)
    for graphs, compression, size in [(True, "fp16", 1), (True, "none", 8), (False, "fp16", 8)]:
        horovod.check_graphs_and_compression(graphs, compression, size)
    for recipe in sorted(os.listdir(os.path.join(REPO, "configs"))):  # no recipe asks for the refused pair
        cfg = load_config(os.path.join(REPO, "configs", recipe))
        wire = gradient_compression(cfg.distributed.compression, cfg.precision)
        assert not (cfg.train.cuda_graphs and wire != "none"), recipe


def test_cuda_graphs_are_captured_in_thread_local_mode_which_torch_documents():
    """The DataLoader's pin-memory thread pins batches (cuMemHostAlloc, cudaEventQuery) while the
    graph may be captured; torch's default "global" mode fails the capture on another thread's unsafe call,
    "thread_local" only on the capturing thread's. The keywords are torch.cuda.graph's own, with a documented
    value, and GraphedStep passes them."""
    assert step.CAPTURE_OPTIONS == {"capture_error_mode": "thread_local"}
    assert set(step.CAPTURE_OPTIONS) <= set(inspect.signature(torch.cuda.graph).parameters)
    documented = re.search(r"capture_error_mode \(str, optional\):(.*?)\n\s*\n", torch.cuda.graph.__doc__, re.S)
    assert documented and '"thread_local"' in documented.group(1) and '"global"' in documented.group(1)
    assert "**CAPTURE_OPTIONS" in inspect.getsource(step.GraphedStep.__init__)


@pytest.mark.parametrize("capability,refused", [((6, 1), True), ((7, 0), False), ((9, 0), False)])
def test_compile_or_fused_on_a_gpu_too_old_for_triton_is_one_line(capability, refused):
    """A P40 (6.1) would get inductor's GPUTooOldForTriton traceback at the first step; a V100
    (7.0) and an H100 (9.0) compile."""
    assert hardware_checks.too_old_for_triton(capability) is refused
    for key in ("train.compile", "optim.fused"):
        if refused:
            with pytest.raises(UserError, match=rf"^{key}=true compiles Triton kernels, which need a GPU of compute "
                                                rf"capability 7\.0 or newer, and this GPU is 6\.1 .*set {key}=false$"):
                hardware_checks.check_triton_gpu(key, capability)
        else:
            hardware_checks.check_triton_gpu(key, capability)


# torch.use_deterministic_algorithms' list of ops that raise on CUDA in deterministic mode, each by the ATen ops that
# alert (torch's CUDA kernels call alertNotDeterministic there); conservative where the alert needs a condition
RAISES_IN_DETERMINISTIC_MODE = {
    "torch.nn.AvgPool3d": ("avg_pool3d_backward",),
    "torch.nn.AdaptiveAvgPool2d": ("_adaptive_avg_pool2d_backward",),
    "torch.nn.AdaptiveAvgPool3d": ("_adaptive_avg_pool3d_backward",),
    "torch.nn.AdaptiveMaxPool2d": ("adaptive_max_pool2d_backward",),
    "torch.nn.FractionalMaxPool2d": ("fractional_max_pool2d_backward",),
    "torch.nn.FractionalMaxPool3d": ("fractional_max_pool3d_backward",),
    "torch.nn.MaxUnpool1d": ("max_unpool2d",),
    "torch.nn.MaxUnpool2d": ("max_unpool2d",),
    "torch.nn.MaxUnpool3d": ("max_unpool3d",),
    "torch.nn.functional.interpolate": ("upsample_linear1d_backward", "upsample_bilinear2d_backward",
                                        "_upsample_bilinear2d_aa_backward", "upsample_bicubic2d_backward",
                                        "_upsample_bicubic2d_aa_backward", "upsample_trilinear3d_backward"),
    "torch.nn.ReflectionPad1d": ("reflection_pad1d_backward",),
    "torch.nn.ReflectionPad2d": ("reflection_pad2d_backward",),
    "torch.nn.ReflectionPad3d": ("reflection_pad3d_backward",),
    "torch.nn.NLLLoss": ("nll_loss2d_forward",),  # the 1-D nll_loss of a classifier reduces deterministically
    "torch.nn.CTCLoss": ("_ctc_loss_backward",),
    "torch.nn.EmbeddingBag": ("_embedding_bag_backward", "_embedding_bag_dense_backward"),
    "torch.Tensor.put_": ("put_", "put"),
    "torch.histc": ("histc",),
    "torch.bincount": ("bincount",),
    "torch.median": ("median",),
    "torch.nn.functional.grid_sample": ("grid_sampler_2d_backward", "grid_sampler_3d_backward"),
    "torch.cumsum": ("cumsum", "cumsum_"),
    "torch.Tensor.scatter_reduce": ("scatter_reduce", "scatter_reduce_"),
    "torch.Tensor.resize_": (),  # on a quantized tensor only: the step has none
}


def test_a_training_step_of_the_resume_rows_recipe_runs_no_op_that_raises_in_deterministic_mode_on_cuda():
    """The GPU check's resume row trains the H100 recipe under train.deterministic=true: an op on torch's list would
    raise there, on the GPU only. One step of each optimizer phase (AdaBound, then SGD+LARS) of the recipe's model,
    loss, scaler and optimizer, profiled on the CPU: none of the ATen ops that alert is called. The list is read
    from the installed torch's documentation, so a torch that adds an op fails here until it is mapped."""
    from benchmarks.bench_sets import precision_sets
    from hybridtrain.distributed.engines import with_step_contract
    from hybridtrain.engine.step import build_train_step
    from hybridtrain.models import model_from_config
    from hybridtrain.optim import apply_schedule, create_optimizer
    from hybridtrain.precision.policy import prepare_model
    from hybridtrain.precision.scaler import create_precision

    raising = torch.use_deterministic_algorithms.__doc__.split("operations will throw")[1].split("In addition")[0]
    assert set(re.findall(r"\* :(?:class|func):`([\w.]+)`", raising)) == set(RAISES_IN_DETERMINISTIC_MODE)
    sets = ["train.device=cpu", "data.backend=synthetic", "data.channels_last=true", "train.deterministic=true",
            "optim.adabound_epochs=1", *precision_sets("mixed-fp16"), "precision.loss_scale=128"]
    cfg = load_config(os.path.join(REPO, "configs", "resnet50_h100.yaml"), sets)
    precision = create_precision(cfg.precision)
    model = prepare_model(model_from_config(cfg.model, 10, seed=0), precision.policy)
    model = model.to(memory_format=torch.channels_last)
    bundle = create_optimizer(model, cfg, 1, 1)
    optimizer = with_step_contract(bundle.optimizer)
    images = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    labels = torch.tensor([1, 7])
    run_step = build_train_step(model, cfg, precision, (images, labels))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for step in (0, 1):  # epoch 0 is AdaBound's, epoch 1 SGD+LARS's (one step per epoch)
            apply_schedule(optimizer, bundle.schedule, step)
            assert run_step(optimizer, precision, [(images, labels, 1.0)]).stepped  # a small scale: no overflow
    ops = {event.name.removeprefix("aten::") for event in profile.events()}
    # the backward, the scaler's check and both phases' updates were traced (AdaBound's sqrt, LARS's norm)
    assert {"convolution_backward", "_amp_foreach_non_finite_check_and_unscale_", "_foreach_sqrt_", "_foreach_norm"} <= ops
    called = {name: sorted(ops & set(aten)) for name, aten in RAISES_IN_DETERMINISTIC_MODE.items() if ops & set(aten)}
    assert not called, called
