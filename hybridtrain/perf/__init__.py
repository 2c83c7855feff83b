"""Benchmarks: measurements that drive the rest of hybridtrain as real processes (``bench``, ``max-batch``,
``bench-data``, ``bench-optim``, ``scale``, and the ``python -m`` probes). May import: predict, engine, reports and
everything below; nothing imports it except ``cli`` (and the GPU check's rows, tests/gpu, for ``bench_sets``)
and ``cluster`` (``scale --cluster`` runs ``scaling``'s rows across its hosts)."""
