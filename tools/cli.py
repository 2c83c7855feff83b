"""``python -m tools``: the research tools beside the trainer, run from the checkout: `predict` (the cluster model),
`cluster` (hosts as network namespaces on this machine) and `experiment` (the paper's named comparisons). Each
handler imports its tool; bad input is one ``hybridtrain: error:`` line, as in the package's own commands."""
from __future__ import annotations

import subprocess
import sys

from hybridtrain.cli import Parser
from hybridtrain.cli.options import (
    RANKS,
    add_engine_option,
    add_recipe_options,
    bounded_float,
    bounded_int,
    with_engine,
)
from hybridtrain.errors import UserError
from hybridtrain.files import check_output_dir
from hybridtrain.launched_by import parse_and_run
from tools.jobs import stopped_cleanly


def cmd_cluster(args) -> int:
    from tools.cluster import netns as cluster
    if args.action == "exec":
        hosts = cluster.hosts_now()
        if not args.command or args.command[0] not in hosts:
            given = f"{args.command[0]} is not a host of the cluster" if args.command else "it was given no host"
            raise UserError(f"cluster exec runs a command on a host of the cluster and {given} (hosts now: "
                            f"{', '.join(hosts) or 'none'}): e.g. python -m tools cluster exec h1 -- hostname")
        host, command = args.command[0], args.command[1:]
        if not command:
            raise UserError(f"cluster exec {host} was given no command to run there: e.g. python -m tools cluster exec "
                            f"{host} -- hostname")
        with cluster.in_use(f"cluster exec {host}", alone=False), \
                stopped_cleanly(f"the command on {host} ended"):
            return subprocess.run(cluster.host_command(host, command)).returncode
    if args.command:
        raise UserError(f"cluster {args.action} takes no command, got '{' '.join(args.command)}'")
    if args.action in ("up", "down"):
        with cluster.in_use(f"cluster {args.action}", alone=True), \
                stopped_cleanly("the cluster is removed (its namespaces, sshds and ranks)", cluster.down):
            if args.action == "up":
                cluster.up(args.hosts, args.link)
            else:
                removed = cluster.down()
                print(f"removed {len(removed)} namespaces" if removed else "no cluster to remove")
                return 0
    cluster.require_root()
    print(cluster.format_status(cluster.status()))
    return 0


def cmd_experiment(args) -> int:
    from tools.experiments import run_experiment
    args.crash_log_dir = args.out  # its runs' folder: a bug's traceback goes to its logs/
    rows = None if args.rows is None else [row.strip() for row in args.rows.split(",") if row.strip()]
    if rows == []:  # not every row: an empty list asked for none
        raise UserError(f"--rows names no row (got {args.rows!r}): name rows as the experiment's table shows them, "
                        f"e.g. --rows hybrid,goyal, or drop --rows to run them all")
    check_output_dir(args.out, "--out")
    with stopped_cleanly("its runs' ranks ended"):
        run_experiment(args.name, args.config, with_engine(args), args.out, args.ranks, args.target, rows)
    return 0


def build_parser() -> Parser:
    parser = Parser(prog="python -m tools", description="The research tools beside the trainer: the cluster model, a "
                                                        "cluster on this machine, the paper's comparisons.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from tools.predict import cli as predict  # the model's defaults and choices are predict's options'
    predict.add_commands(sub)
    clu = sub.add_parser("cluster", help="N hosts on this machine (network namespaces with an sshd each, joined by "
                                         "a bridge, links limited with tc tbf): up, down, status, exec HOST -- CMD")
    clu.add_argument("action", choices=("up", "down", "status", "exec"))
    clu.add_argument("command", nargs="*", help="exec: the host and its command, e.g. h1 -- hostname")
    clu.add_argument("--hosts", type=bounded_int(2, 200), default=2, help="up: the number of hosts (default 2)")
    clu.add_argument("--link", default="none", help="up: each host's link rate as tc writes it (100mbit, 1gbit, "
                                                    "10gbit) or none (default none)")
    clu.set_defaults(func=cmd_cluster)

    exp = sub.add_parser("experiment", help="run a named comparison on 2+ ranks (optimizers, warmup-epochs, "
                                            "lars, precision, layered, bn, init, gamma, recipes)")
    exp.add_argument("name", help="optimizers (paper Fig 3.1), warmup-epochs (Fig 3.2), lars (LARS defaults), "
                                  "precision (Fig 3.3), layered (per-layer precision), bn (Table 3.4), init "
                                  "(Table 3.5), gamma (Table 3.6) or recipes (hybrid, mlperf, goyal, each alone and "
                                  "with label smoothing, EMA, progressive resizing)")
    add_recipe_options(exp, "base recipe (default configs/demo.yaml)", "override for every row",
                       default="configs/demo.yaml")
    exp.add_argument("--out", default="runs/experiments", help="where tables, JSON and PNGs go")
    exp.add_argument("--ranks", type=RANKS, default=2, help="ranks per row (default 2)")
    add_engine_option(exp)
    exp.add_argument("--rows", metavar="NAME,...", help="run only these rows of the experiment (comma-separated "
                                                        "names, as its table shows them)")
    exp.add_argument("--target", type=bounded_float(0, 1, lo_open=True),
                     help="val top-1 target for epochs-to-target (default: the recipe's report.top1_target)")
    exp.set_defaults(func=cmd_experiment)
    return parser


def main(argv=None) -> int:
    return parse_and_run(build_parser().parse_args, sys.argv[1:] if argv is None else list(argv))
