"""The training engine: one run on one rank, from the built trainer to the last epoch.

- ``trainer``: what a rank trains with (model, data, optimizer, precision, step), built once;
- ``loop``: the epoch loop and the one end-of-epoch path (BN averaging, checkpoint, validation, record);
- ``epoch``: the batch loop of one epoch, and validation;
- ``step``: how one step's forward and backward run (eager, compiled, CUDA graph) and the whole step;
- ``resume``, ``checkpoint``, ``rundir``: what a run keeps on disk and how it continues;
- ``elastic``, ``preemption``, ``watchdog``: ranks that come, go, are stopped or hang;
- ``telemetry``, ``records``, ``memory``: what a run says and records.

May import: data, models, optim, precision, distributed, config, errors. Never perf, reports or cli.
"""
