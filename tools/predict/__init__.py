"""The cluster model behind ``python -m tools predict``: what N GPUs would give, from measured single-GPU rates.

- ``cluster_model``: the all-reduce algorithms (ring, tree, hierarchical) over a cluster's links, and the scaling
  efficiency they leave;
- ``time_to_target``: the time to a top-1 target on N GPUs, against published runs.

``predict``'s run, tables and figures are the command's: ``predict/cli.py``.

May import: hybridtrain and tools.options. Imported by tools.cli and tools.cluster (``scale --cluster`` sets its
measured rows beside the model's).
"""
