"""`hybridtrain train`: its options, the run, and running out of memory as one line naming the batch."""
from __future__ import annotations

from hybridtrain.cli.options import add_engine_option, add_recipe_options, with_engine
from hybridtrain.errors import UserError


def cmd_train(args) -> int:
    # The command line, the recipe, its --set overrides and its paths are checked first, without torch or Horovod
    # (config and launcher import neither): a typo is refused in a fraction of a second, not after ~5 s of imports.
    # What needs torch (the device, the data, the run_dir's lock) is checked by the engine afterwards.
    from hybridtrain.config import load_config
    if args.resume not in (None, "required", "auto"):
        raise UserError(f"--resume takes no value or 'auto', got '{args.resume}': e.g. --resume auto")
    cfg = load_config(args.config, with_engine(args) + (["profile.enabled=true"] if args.profile else []),
                      for_command="train")
    args.crash_log_dir = cfg.run_dir  # where run_guarded writes a rank's traceback if a bug stops it
    from hybridtrain.engine.sinks import check_sinks  # torch-free: a missing tracker is one line before the work
    check_sinks(cfg)
    from hybridtrain.distributed.engines import refuse_elastic
    from hybridtrain.distributed.launcher import check_launch  # the launcher's variables: one line, never a wait
    engine = check_launch(cfg.distributed.engine)
    if args.elastic:
        refuse_elastic(engine)
        from hybridtrain.engine.elastic import run_elastic  # torch and Horovod from here on
        finished = explaining_memory(cfg, lambda: run_elastic(cfg, args.resume, args.move_aside))
    else:
        from hybridtrain.engine.loop import run_training  # torch from here on
        finished = explaining_memory(cfg, lambda: run_training(cfg, resume=args.resume, move_aside=args.move_aside))
    if finished:  # rank 0 of a run that trained its last epoch: the paper's report
        from hybridtrain.reports.report import report_run, summary_table
        print(summary_table(report_run(cfg.run_dir, extra=finished)), flush=True)
        from hybridtrain.engine.sinks import log_report
        log_report(cfg)  # the report's files to MLflow / W&B (sinks.*), when asked for
    return 0


def out_of_memory_device(exc: BaseException) -> str | None:
    """'GPU' or 'CPU' when ``exc`` is torch running out of memory, else None: torch.OutOfMemoryError (CUDA's caching
    allocator, c10::OutOfMemoryError; torch.cuda.OutOfMemoryError is the same class), or the RuntimeError of the CPU
    allocator (c10/core/impl/alloc_cpu.cpp: "DefaultCPUAllocator: can't allocate memory")."""
    import torch  # loaded already: the engine ran
    if isinstance(exc, torch.OutOfMemoryError):
        return "CPU" if "DefaultCPUAllocator" in str(exc) else "GPU"
    if isinstance(exc, RuntimeError) and "DefaultCPUAllocator" in str(exc) and \
            ("can't allocate memory" in str(exc) or "not enough memory" in str(exc)):
        return "CPU"
    return None


def explaining_memory(cfg, train):
    """``train()``; running out of memory at a batch the config allows is one line naming the batch and the fix."""
    try:
        return train()
    except RuntimeError as exc:
        device = out_of_memory_device(exc)
        if device is None:
            raise
        t, val_batch = cfg.train, cfg.data.val_batch_size or cfg.train.batch_size
        half = max(1, t.batch_size // 2)
        raise UserError(f"out of {device} memory at train.batch_size={t.batch_size} per rank (data.val_batch_size="
                        f"{val_batch}, data.crop_size={cfg.data.crop_size}, precision.mode={cfg.precision.mode}): "
                        f"lower train.batch_size (e.g. --set train.batch_size={half} --set train.accumulation_steps="
                        f"{t.accumulation_steps * 2} keeps the global batch), or data.val_batch_size if validation "
                        f"ran out; 'python -m benchmarks max-batch' finds the largest batch that fits a GPU",
                        same_on_all_ranks=False) from None


def add_commands(sub) -> None:
    """train's parser."""
    train = sub.add_parser("train", help="train a ResNet under horovodrun/mpirun or torchrun (or alone as one rank)")
    add_recipe_options(train, "recipe YAML, e.g. configs/demo.yaml", required=True,
                       set_help="override a config key, e.g. --set train.epochs=5 (repeatable)")
    add_engine_option(train)
    train.add_argument("--resume", nargs="?", const="required", metavar="auto",
                       help="continue from the newest valid checkpoint in run_dir; '--resume auto' starts fresh "
                            "when there is none (for job scripts that requeue themselves)")
    train.add_argument("--move-aside", action="store_true",
                       help="a fresh run into a run_dir that holds a previous run's files moves them into "
                            "run_dir/previous-<time>/ (without it the run is refused)")
    train.add_argument("--elastic", action="store_true",
                       help="Horovod elastic training: ranks may leave and join (horovodrun --min-np/--max-np "
                            "--host-discovery-script; docs/elastic.md)")
    train.add_argument("--profile", action="store_true",
                       help="torch.profiler over a window of steps on every rank (profile.wait/warmup/active): a "
                            "Chrome/Perfetto trace per rank in run_dir/profile/ (profile.enabled)")
    train.set_defaults(func=cmd_train)
