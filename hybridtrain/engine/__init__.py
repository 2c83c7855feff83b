"""The training engine: one run on one rank, from the built trainer to the last epoch.

- ``trainer``: what a rank trains with (model, data, optimizer, precision, step), built once;
- ``loop``: the epoch loop and the one end-of-epoch path (BN averaging, checkpoint, validation, record);
- ``epoch``: the batch loop of one epoch, and validation;
- ``step``: the whole step (zero, passes, update or a skipped one undone) and how its passes run (eager, compiled,
  CUDA graph);
- ``resume``, ``checkpoint``, ``rundir``: what a run keeps on disk and how it continues;
- ``elastic``, ``guards``: ranks that come, go, are stopped (SIGTERM) or hang (the stall watchdog);
- ``records``: what a run says and records (the loop's RunRecord, the log, the progress bar, TensorBoard, peak memory).

May import: data, models, optim, precision, distributed, config, errors. Never perf, reports or cli.
"""
