"""Which host's link is slow, from timed transfers between pairs of hosts (``link_probe.json``, written by
``python -m tools.cluster.link_probe``; the run's report shows it when the run_dir holds one).

A transfer between hosts a and b crosses a's link and b's, so it goes at about the slower of the two. A host's link
rate is therefore the fastest of its transfers (with a partner faster than it, that transfer is limited by its own
link alone), and a host is slow when the other hosts' median rate is ``SLOW_FACTOR`` times its own or more. Two hosts
give one transfer and so cannot tell which end is slow: three or more are needed.
"""
from __future__ import annotations

import json
import os
import statistics

from hybridtrain.errors import UserError
from hybridtrain.reports import markdown_table

PROBE_FILE = "link_probe.json"
SLOW_FACTOR = 3.0  # a host this many times slower than the others' median is named


def host_rates(pairs: list[dict]) -> dict[str, float]:
    """Each host's link rate in bit/s: the fastest transfer it took part in."""
    rates: dict[str, float] = {}
    for pair in pairs:
        for host in (pair["from"], pair["to"]):
            rates[host] = max(rates.get(host, 0.0), pair["bits_per_s"])
    return rates


def slow_hosts(rates: dict[str, float]) -> list[tuple[str, float, float]]:
    """(host, its rate, the others' median rate) for each host at least SLOW_FACTOR times slower than the others,
    slowest first; none with fewer than three hosts."""
    if len(rates) < 3:
        return []
    found = []
    for host, rate in rates.items():
        others = statistics.median(r for h, r in rates.items() if h != host)
        if others >= SLOW_FACTOR * rate:
            found.append((host, rate, others))
    return sorted(found, key=lambda x: x[1])


def mbit(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e6:.0f}" if bits_per_s >= 10e6 else f"{bits_per_s / 1e6:.1f}"


def links_lines(rates: dict[str, float]) -> list[str]:
    """One line per slow host ("host h1's link: 9.8x slower than the others (12 Mbit/s vs 118)"), or one line saying
    there is none, or that two hosts cannot tell."""
    if len(rates) < 3:
        return [f"hosts {' and '.join(sorted(rates))}: {mbit(max(rates.values()))} Mbit/s between them; with two "
                f"hosts a slow link cannot be put on either end (probe three or more)"]
    slow = slow_hosts(rates)
    if not slow:
        return [f"no slow link: every host within {SLOW_FACTOR:g}x of the others' median "
                f"({mbit(statistics.median(rates.values()))} Mbit/s)"]
    return [f"host {host}'s link: {others / rate:.1f}x slower than the others ({mbit(rate)} Mbit/s vs {mbit(others)})"
            for host, rate, others in slow]


# The rates a transfer can have been measured at: a modem's to past any network card's. Outside, the record's numbers
# are not a measurement (a transfer of no bytes, a clock that did not move, a hand-edited file).
RATE_RANGE = (1e3, 1e13)


def probe_problem(pairs) -> str:
    """'' when ``pairs`` are timed transfers between two or more hosts, each at a measurable rate, else what is
    wrong with them (read before anything is computed from them: a rate of 0 or inf would show as 'inf x slower')."""
    if not isinstance(pairs, list) or not pairs:
        return "no transfer"
    hosts = set()
    for pair in pairs:
        if not isinstance(pair, dict) or not all(isinstance(pair.get(k), str) and pair[k] for k in ("from", "to")):
            return f"a transfer without its two hosts ({str(pair)[:60]})"
        rate = pair.get("bits_per_s")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not RATE_RANGE[0] <= rate <= RATE_RANGE[1]:
            return (f"the transfer {pair['from']} -> {pair['to']} at {str(rate)[:40]} bit/s, which is no measured "
                    f"rate (1 kbit/s to 10 Tbit/s)")
        if pair["from"] == pair["to"]:
            return f"a transfer from {pair['from']} to itself"
        hosts |= {pair["from"], pair["to"]}
    return "" if len(hosts) >= 2 else "one host"


def read_probe(run_dir: str) -> dict | None:
    """The run_dir's link_probe.json, checked, with each host's rate and the lines; None when it has none."""
    path = os.path.join(run_dir, PROBE_FILE)
    if not os.path.isfile(path):
        return None
    fix = "run python -m tools.cluster.link_probe --out RUN_DIR again, or move the file out of the run_dir"
    try:
        with open(path, encoding="utf-8") as fh:
            probe = json.load(fh)
        problem = probe_problem(probe["pairs"]) if isinstance(probe, dict) else f"a {type(probe).__name__}"
    except (UnicodeDecodeError, ValueError, KeyError) as exc:
        problem = f"{type(exc).__name__}: {str(exc)[:60]}"
    if problem:
        raise UserError(f"{path} is not a link probe ({problem}): {fix}")
    rates = host_rates(probe["pairs"])
    return {**probe, "host_bits_per_s": rates, "slow_hosts": [h for h, _, _ in slow_hosts(rates)],
            "lines": links_lines(rates)}


def links_markdown(probe: dict) -> str:
    """The report's section: the lines, then each host's rate."""
    rows = [[host, mbit(rate), "slow" if host in probe["slow_hosts"] else ""]
            for host, rate in sorted(probe["host_bits_per_s"].items())]
    return "\n".join(["## Links", "", *[f"- {line}" for line in probe["lines"]], "",
                      f"Timed transfers of {probe.get('megabytes', '?')} MB between every pair of hosts "
                      f"({PROBE_FILE}, {probe.get('measured_at', 'time unknown')}); a host's rate is its fastest "
                      f"transfer.", "", markdown_table(["host", "Mbit/s", ""], rows), ""])
