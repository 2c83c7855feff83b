"""Horovod, the runtime under the engine: init and rank -> device binding, broadcast, the gradient all-reduce and its
compressors (``horovod``), and naming a rank that died (``failures``).

May import: config, errors.
"""
