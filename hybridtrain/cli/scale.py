"""Scaling out: `scale` (img/s at several rank counts, or across a --cluster), `cluster` (hosts as
network namespaces on this machine)."""
from __future__ import annotations

import subprocess

from hybridtrain.cli.options import add_recipe_options, add_timing_options, bounded_int, count_list
from hybridtrain.distributed.engines import registered
from hybridtrain.errors import UserError
from hybridtrain.outputs import check_output_dir, check_output_file, write_json_atomically


def cmd_scale(args) -> int:
    from hybridtrain.cluster import netns as cluster
    args.crash_log_dir = args.out  # its runs' folder: a bug's traceback goes to its logs/
    check_output_dir(args.out, "--out")
    if args.json:
        check_output_file(args.json, "--json")
    if args.cluster and args.np is not None:
        raise UserError("--np counts ranks on this machine; --cluster N runs one rank on each of N hosts: drop one")
    if not args.cluster and args.link != "none":  # the default
        raise UserError(f"--link {args.link} limits the links of a --cluster: add --cluster N, or drop --link")
    from hybridtrain.perf.scaling import format_table, parse_compressions, run_scale
    if args.cluster:
        from hybridtrain.cluster.scale import format_cluster_table, parse_links, run_cluster_scale
        with cluster.in_use("scale --cluster", alone=True), cluster.stopped_cleanly(
                "the rows' ranks ended and the cluster is removed (its namespaces, sshds and ranks)", cluster.down):
            rows = run_cluster_scale(args.config, args.set, args.cluster, parse_links(args.link),
                                     parse_compressions(args.compression), parse_engines(args.engine), args.steps,
                                     args.warmup, args.out, args.oversubscribe)
        table, written = format_cluster_table(rows), "scale_cluster.json and scale_cluster.png"
    else:
        with cluster.stopped_cleanly("its ranks ended"):
            rows = run_scale(args.config, args.set, args.np or [1, 2], parse_compressions(args.compression),
                             args.steps, args.warmup, args.out, args.oversubscribe, parse_engines(args.engine))
        table, written = format_table(rows), "scale.json and scale.png"
    print(table)
    print(f"{written} written to {args.out}")
    if args.json:
        write_json_atomically(args.json, {"config": args.config, "overrides": args.set, "rows": rows})
        print(f"rows written to {args.json}")
    return 0


def parse_engines(text: str) -> tuple[str, ...]:
    names, engines = tuple(x.strip() for x in text.split(",") if x.strip()), registered()
    if not names or any(n not in engines for n in names) or len(set(names)) != len(names):
        raise UserError(f"--engine must list registered engines ({', '.join(engines)}), each once, got '{text}': "
                        f"e.g. --engine horovod,torch")
    return names


def cmd_cluster(args) -> int:
    from hybridtrain.cluster import netns as cluster
    if args.action == "exec":
        hosts = cluster.hosts_now()
        if not args.command or args.command[0] not in hosts:
            given = f"{args.command[0]} is not a host of the cluster" if args.command else "it was given no host"
            raise UserError(f"cluster exec runs a command on a host of the cluster and {given} (hosts now: "
                            f"{', '.join(hosts) or 'none'}): e.g. hybridtrain cluster exec h1 -- hostname")
        host, command = args.command[0], args.command[1:]
        if not command:
            raise UserError(f"cluster exec {host} was given no command to run there: e.g. hybridtrain cluster exec "
                            f"{host} -- hostname")
        with cluster.in_use(f"cluster exec {host}", alone=False), \
                cluster.stopped_cleanly(f"the command on {host} ended"):
            return subprocess.run(cluster.host_command(host, command)).returncode
    if args.command:
        raise UserError(f"cluster {args.action} takes no command, got '{' '.join(args.command)}'")
    if args.action in ("up", "down"):
        with cluster.in_use(f"cluster {args.action}", alone=True), \
                cluster.stopped_cleanly("the cluster is removed (its namespaces, sshds and ranks)", cluster.down):
            if args.action == "up":
                cluster.up(args.hosts, args.link)
            else:
                removed = cluster.down()
                print(f"removed {len(removed)} namespaces" if removed else "no cluster to remove")
                return 0
    cluster.require_root()
    print(cluster.format_status(cluster.status()))
    return 0


def add_commands(sub) -> None:
    """scale and cluster's parsers."""
    scale = sub.add_parser("scale", help="synthetic-data benchmark at several rank counts: img/s, efficiency, "
                                         "all-reduce bytes and time")
    add_recipe_options(scale, "model, per-rank batch, crop and precision", default="configs/demo.yaml")
    scale.add_argument("--np", type=count_list(1, 4096), help="rank counts, e.g. 1,2 (default 1,2)")
    scale.add_argument("--compression", default="fp16,none", help="fp16 and/or none (default fp16,none)")
    add_timing_options(scale, 20, 5)
    scale.add_argument("--out", default="runs/scale", help="where scale.json, scale.png and timelines go")
    scale.add_argument("--engine", default="horovod",
                       help="the engines to measure, e.g. horovod,torch: rows under horovodrun and under torchrun "
                            "(default horovod)")
    scale.add_argument("--oversubscribe", action="store_true",
                       help="allow more ranks than cores (for calibrating predict on a small machine)")
    scale.add_argument("--cluster", type=bounded_int(2, 200), metavar="N",
                       help="run the rows across N hosts of a cluster in a box, one rank each (root; hybridtrain "
                            "cluster; docs/cluster.md), next to predict's all-reduce model")
    scale.add_argument("--link", default="none", help="with --cluster: each host's link rate as tc writes it (100mbit, "
                                                      "1gbit, 10gbit) or none, or several: 100mbit,1gbit,none "
                                                      "(default none)")
    scale.add_argument("--json", help="also write the rows to this JSON file")
    scale.set_defaults(func=cmd_scale)

    clu = sub.add_parser("cluster", help="N hosts on this machine (network namespaces with an sshd each, joined by "
                                         "a bridge, links limited with tc tbf): up, down, status, exec HOST -- CMD")
    clu.add_argument("action", choices=("up", "down", "status", "exec"))
    clu.add_argument("command", nargs="*", help="exec: the host and its command, e.g. h1 -- hostname")
    clu.add_argument("--hosts", type=bounded_int(2, 200), default=2, help="up: the number of hosts (default 2)")
    clu.add_argument("--link", default="none", help="up: each host's link rate as tc writes it (100mbit, 1gbit, "
                                                    "10gbit) or none (default none)")
    clu.set_defaults(func=cmd_cluster)
