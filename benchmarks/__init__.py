"""The trainer's benchmarks, run from the checkout as ``python -m benchmarks bench|max-batch|bench-optim|bench-data|
scale`` (``cli``), and the probes whose figures docs/benchmarks.md quotes (``python -m benchmarks.probes.NAME``):
measurements that drive the trainer as real processes. May import: hybridtrain, ``tools.jobs`` and
``tools.options``; ``cli`` also the cluster in a box (``scale --cluster``). Imported by ``tools.cluster`` (its rows
are ``scaling``'s)."""
