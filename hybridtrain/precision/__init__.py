"""Compute precision: what a ``precision.mode`` means for parameters, inputs, autocast and the gradient compression
(``policy``), and loss scaling around Horovod's step (``scaler``).

May import: models, distributed, config, errors.
"""
