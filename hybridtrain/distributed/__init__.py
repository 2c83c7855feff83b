"""The data-parallel engines behind one face: ``collectives`` is what the trainer calls (init, broadcast, the
wrapped model and optimizer, averages, barriers), and it dispatches to the engine that formed the job; ``engines``
is the contract (a Protocol) and the registry (name, module, launcher, its variables, its peer-failure words);
``horovod`` and ``torch_distributed`` are the two engines; ``launch_env`` and ``launcher`` read and check the
launcher's environment and build launch commands; ``topology`` binds a rank to its device; ``layout`` gives
tensors of any memory layout to element-wise collectives; ``failures`` names a rank that died.

May import: errors, launched_by. Only this package imports an engine module, Horovod or torch.distributed.
"""
