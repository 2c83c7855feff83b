"""The emulated cluster on one machine: hosts as network namespaces, and what runs across them.

- ``netns``: N hosts as network namespaces with sshd, joined by rate-limited links (``python -m tools cluster``);
- ``scale``: the ``scale`` rows across the hosts, beside ``predict``'s model of them (``scale --cluster``);
- ``link_probe``: timed transfers between every pair of hosts over ssh, naming a slow link (``python -m``).

May import: benchmarks (``scale --cluster`` runs ``scaling``'s rows), tools.predict, tools.jobs and hybridtrain.
Imported by the commands (tools.cli, benchmarks.cli).
"""
