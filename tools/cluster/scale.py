"""``python -m benchmarks scale --cluster N --link RATE``: the ``scale`` rows across N hosts of a cluster in a box
(tools/cluster/netns.py), one rank per host, every host's link limited to RATE, next to what
``predict``'s all-reduce model gives for them.

Per engine: one rank alone (no cluster) gives the compute time per step t1 = step time of the 1-rank row and
S1 = its img/s. Then the cluster comes up and each (engine, compression) row runs N ranks, one per host
(``horovodrun -H h0:1,h1:1,...`` over ssh from h0; one ``torchrun`` per host with a c10d rendezvous on h0). The
prediction is cluster_model.predict for a flat ring of N nodes of one GPU: compute t1, the gradients as 2 (fp16) or
4 (none) bytes per parameter, the link rate as the bandwidth, latency 0 (netem is absent, so the links add none),
no overlap; with ``--link none`` the links have no rate and the prediction is compute alone, N x S1. Each row also
keeps the hosts' TCP retransmitted segments and dropped packets during the row (netns.link_counters).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from benchmarks.scaling import available_slots, launch, measured_config
from hybridtrain.distributed.launcher import venv_tool
from hybridtrain.errors import UserError
from hybridtrain.files import figure, save_figure, write_json_atomically, write_text_atomically
from hybridtrain.reports import markdown_table
from tools.cluster import netns as cluster
from tools.jobs import checkout_env, last_error_line
from tools.predict.cluster_model import ClusterSpec, predict

RDZV_PORT = 29400
BYTES_PER_ELEMENT = {"fp16": 2, "none": 4}


def predicted_images_per_sec(compute_time_s: float, batch_per_rank: int, parameters: int, compression: str,
                             hosts: int, link: str) -> float:
    """predict's flat-ring model for ``hosts`` one-rank nodes joined by links of rate ``link`` (none: no limit)."""
    bits = cluster.link_bits_per_s(link)
    if bits is None:
        return hosts * batch_per_rank / compute_time_s  # no rate limit: compute alone
    bandwidth = bits / 8
    spec = ClusterSpec(compute_time=compute_time_s, batch_per_gpu=batch_per_rank, parameter_count=parameters,
                       bytes_per_element=BYTES_PER_ELEMENT[compression], gpus_per_node=1, nodes=hosts,
                       intra_bandwidth=bandwidth, intra_latency=0.0, inter_bandwidth=bandwidth, inter_latency=0.0)
    return predict(spec).images_per_second


def host_commands(engine: str, hosts: list[str], program: list[str], tag: str) -> list[list[str]]:
    """The commands that start ``program`` as one rank per host: horovodrun over ssh from the first host, or one
    torchrun per host with a c10d rendezvous on the first (is_host says which agent serves it)."""
    if engine == "horovod":
        return [cluster.host_command(hosts[0], [
            venv_tool("horovodrun"), "--gloo", "-np", str(len(hosts)), "-H", ",".join(f"{h}:1" for h in hosts),
            "--network-interfaces", "eth0", "--start-timeout", "120", *program])]
    return [cluster.host_command(host, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:{RDZV_PORT}", "--rdzv-id", tag,
        "--rdzv-conf", f"is_host={int(i == 0)}", "--max-restarts", "0", "--no-python", *program])
        for i, host in enumerate(hosts)]


def cluster_row(config: str | None, overrides: list[str], hosts: list[str], compression: str, steps: int,
                warmup: int, out: str, engine: str) -> dict:
    """One row across the hosts: their launch, rank 0's record, the links' retransmits and drops meanwhile."""
    tag = f"{engine}-hosts{len(hosts)}-{compression}"
    record_path = os.path.join(out, f"{tag}.json")
    if os.path.exists(record_path):
        os.remove(record_path)
    program = [sys.executable, "-m", "benchmarks.scaling", config or "", compression, str(steps), str(warmup),
               record_path, "adabound", *overrides, f"distributed.engine={engine}"]
    before = cluster.link_counters(hosts)
    procs = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=checkout_env()) for cmd in host_commands(engine, hosts, program, tag)]
    print("+ " + shlex.join(procs[0].args), flush=True)
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs) or not os.path.isfile(record_path):
        output = "\n".join(outputs)
        write_text_atomically(os.path.join(out, f"{tag}.log"), output)
        raise UserError(f"cluster row {engine} compression={compression} failed: {last_error_line(output)} (output "
                        f"in {out}/{tag}.log)", same_on_all_ranks=False)
    after = cluster.link_counters(hosts)
    with open(record_path) as fh:
        record = json.load(fh)
    return {**record, **{key: after[key] - before[key] for key in after}}


def parse_links(text: str) -> list[str]:
    """--link's rates, e.g. 100mbit,1gbit,none, each checked."""
    links = [x.strip() for x in text.split(",") if x.strip()]
    if not links or len(set(links)) != len(links):
        raise UserError(f"--link must list link rates, each once (e.g. 100mbit,1gbit,10gbit,none), got '{text}'")
    for link in links:
        cluster.link_bits_per_s(link)
    return links


def run_cluster_scale(config: str | None, overrides: list[str], hosts: int, links: list[str],
                      compressions: list[str], engines: tuple[str, ...], steps: int, warmup: int, out: str,
                      oversubscribe: bool) -> list[dict]:
    """The rows at every link rate of ``links`` (the cluster comes up once; each rate is set on every host's link),
    next to their prediction; ``scale_cluster.json`` and ``scale_cluster.png`` in ``out``."""
    cluster.require_root()
    for compression in compressions:  # a bad recipe fails before anything starts
        measured_config(config, overrides, compression)
    slots, unit = available_slots("cpu")
    if hosts > slots and not oversubscribe:
        raise UserError(f"--cluster {hosts} runs one rank per host, {hosts} ranks on this machine's {slots} "
                        f"{unit}s: use --cluster up to {slots}, or --oversubscribe (which measures contention)")
    os.makedirs(out, exist_ok=True)
    single = {engine: launch(config, overrides, 1, "none", steps, warmup, out, timeline=False, engine=engine)
              for engine in engines}  # compute time and S1: one rank, no all-reduce
    names = [cluster.host_name(i) for i in range(hosts)]
    rows = []
    cluster.up(hosts, links[0])
    try:
        for link in links:
            for host in names:
                cluster.set_link(host, link)
            for engine in engines:
                one = single[engine]
                for compression in compressions:
                    record = cluster_row(config, overrides, names, compression, steps, warmup, out, engine)
                    predicted = predicted_images_per_sec(one["step_time_s"], record["batch_per_rank"],
                                                         record["parameters"], compression, hosts, link)
                    rows.append({**record, "link": link, "hosts": hosts,
                                 "single_rank_images_per_sec": one["images_per_sec"],
                                 "compute_time_s": one["step_time_s"],
                                 "efficiency": record["images_per_sec"] / (hosts * one["images_per_sec"]),
                                 "predicted_images_per_sec": predicted,
                                 "predicted_efficiency": predicted / (hosts * one["images_per_sec"])})
    finally:
        cluster.down()
    write_json_atomically(os.path.join(out, "scale_cluster.json"), {"config": config, "overrides": overrides,
                                                                     "rows": rows})
    plot_link_rates(rows, os.path.join(out, "scale_cluster.png"))
    return rows


def plot_link_rates(rows: list[dict], path: str) -> str:
    """Efficiency against link rate, measured (solid) and predicted (dashed), one colour per engine and wire;
    ``none`` (no limit) drawn a decade past the fastest rate."""
    rates = sorted({cluster.link_bits_per_s(r["link"]) for r in rows} - {None})
    beyond = 10 * (rates[-1] if rates else 1e9)
    def x(link: str) -> float:
        return cluster.link_bits_per_s(link) or beyond
    fig = figure(7, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for index, (engine, compression) in enumerate(sorted({(r["engine"], r["compression"]) for r in rows})):
        mine = sorted((r for r in rows if (r["engine"], r["compression"]) == (engine, compression)),
                      key=lambda r: x(r["link"]))
        label = f"{engine}, {'FP16' if compression == 'fp16' else 'FP32'} wire"
        color = f"C{index}"
        ax.plot([x(r["link"]) for r in mine], [100 * r["efficiency"] for r in mine], marker="o", color=color,
                label=f"{label}, measured")
        ax.plot([x(r["link"]) for r in mine], [100 * r["predicted_efficiency"] for r in mine], linestyle="--",
                marker="x", color=color, label=f"{label}, predicted")
    ticks = [*rates, beyond] if any(r["link"] == "none" for r in rows) else rates
    ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{t / 1e9:g} Gbit/s" if t < beyond else "no limit" for t in ticks])
    ax.set(xlabel="link rate per host", ylabel="scaling efficiency (%)",
           title=f"{rows[0]['hosts']} hosts, one rank each: actual / (N x S1)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def format_cluster_table(rows: list[dict]) -> str:
    header = ["link", "engine", "hosts", "compression", "img/s", "predicted img/s", "efficiency",
              "predicted efficiency", "step ms", "TCP retransmits", "drops", "backlog drops"]
    return markdown_table(header, [[r["link"], r["engine"], r["hosts"], r["compression"],
                                    f"{r['images_per_sec']:.1f}", f"{r['predicted_images_per_sec']:.1f}",
                                    f"{100 * r['efficiency']:.1f}%", f"{100 * r['predicted_efficiency']:.1f}%",
                                    f"{1000 * r['step_time_s']:.1f}", r["tcp_retransmits"], r["dropped_packets"],
                                    r["backlog_drops"]]
                                   for r in rows])
