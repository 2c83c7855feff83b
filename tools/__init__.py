"""The research tools beside the trainer, run from the checkout as ``python -m tools predict|cluster|experiment``.

- ``predict/``: the cluster model (step time, efficiency, time to a top-1 target on N GPUs) and its command;
- ``cluster/``: N hosts as network namespaces on this machine, ``scale --cluster``'s rows across them, the link probe;
- ``experiments``: the paper's named comparisons, each a table of 2-rank runs;
- ``jobs``: start a launcher job, stop it cleanly, report its last error line (benchmarks/ uses it too);
- ``options``: the bounds and option types the tools' parsers share.

They import hybridtrain; nothing of hybridtrain imports them. Their floors, top first: the commands (``cli``,
``benchmarks.cli``) -> cluster, experiments -> predict -> benchmarks -> jobs, options -> hybridtrain.
"""
