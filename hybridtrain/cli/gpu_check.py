"""`hybridtrain gpu-check`: the GPU acceptance check on a lent GPU machine (--plan, --rehearse on a CPU one)."""
from __future__ import annotations

from hybridtrain.cli.options import bounded_float, bounded_int
from hybridtrain.errors import UserError


def refuse_unused(args, mode: str, unused: tuple[str, ...]) -> None:
    """One line when an option that ``mode`` ignores was given (argparse's defaults are None or False here)."""
    given = [option for option in unused if getattr(args, option.lstrip("-").replace("-", "_")) not in (None, False)]
    if given:
        raise UserError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing with {mode}: drop "
                        f"{' and '.join(given)}")


def cmd_gpu_check(args) -> int:
    if args.gpus is not None and not args.plan:
        raise UserError("--gpus is for --plan (a real check counts the GPUs it finds): drop --gpus")
    if args.plan:  # prints the rows: no call, no build, no results to bring back
        refuse_unused(args, "--plan (it only prints the rows)",
                      ("--archive", "--bundle", "--venv", "--budget-s", "--fresh", "--rehearse"))
        from hybridtrain.gpucheck.rows import Pythons, build_rows, format_plan, plan_calls
        print(format_plan(plan_calls(build_rows(args.gpus or 1, args.out or "OUT", Pythons(horovod_bin="VENV/bin")))))
        return 0
    if args.rehearse:
        if args.archive is not None:
            raise UserError("--archive brings a GPU call's results back; --rehearse writes its table to --out: "
                            "drop --archive")
        refuse_unused(args, "--rehearse (every step, each time, no time budget)", ("--budget-s", "--fresh"))
        from hybridtrain.gpucheck.rehearsal import rehearse
        return rehearse(args.out, args.bundle, args.venv)
    from hybridtrain.gpucheck.check import BUDGET_S, OUT, run_gpu_check
    args.crash_log_dir = args.out or OUT  # its table's folder: a bug's traceback goes to its logs/
    return run_gpu_check(args.out, args.bundle, args.venv, args.budget_s or BUDGET_S, args.fresh, args.archive)


def add_commands(sub) -> None:
    """gpu-check's parser."""
    gpu = sub.add_parser("gpu-check", help="the GPU path on a (lent, offline) GPU machine in calls of a few minutes: "
                                           "the step against a plain AMP loop on both engines, resume, graphs, "
                                           "compile, the largest batch; one table, written after every row")
    gpu.add_argument("--out", help="folder for gpu_check.md/.json and one <row>.log per row; a second call with "
                                   "the same folder skips the rows that passed (default .gpu-check/out of the "
                                   "checkout, git-ignored; --rehearse: .gpu-check/rehearsal)")
    gpu.add_argument("--archive", metavar="DIR", help="end the call by writing DIR/gpu-check.tgz: the table, each "
                                                      "row's log and figures (under 16 MiB), a refusal's line too; "
                                                      "give the device machine's $OUT")
    gpu.add_argument("--bundle", help="what the machine lacks for the Horovod build (make gpu-bundle; default "
                                      ".gpu-bundle/ of the checkout when it exists)")
    gpu.add_argument("--venv", help="venv for the Horovod build (default .gpu-check/venv of the checkout)")
    gpu.add_argument("--budget-s", type=bounded_float(0, 86400, lo_open=True),  # a day
                     help="time for this call, the node checks included; a row that would not fit is left for "
                          "the next call (default 480)")
    gpu.add_argument("--fresh", action="store_true", help="run every row again, ignoring an earlier call's table")
    gpu.add_argument("--plan", action="store_true", help="print the rows, their estimated seconds on an H100 and "
                                                         "the call each falls in; needs no GPU")
    gpu.add_argument("--gpus", type=bounded_int(1, 64), help="--plan: the GPUs to plan for (default 1)")
    gpu.add_argument("--rehearse", action="store_true",
                     help="on a CPU machine: every step a call takes before its first GPU step (an image-like venv, "
                          "the Horovod build from --bundle, each row's imports and launch); exit 0 when all work")
    gpu.set_defaults(func=cmd_gpu_check)
