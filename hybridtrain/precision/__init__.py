"""Compute precision: what a ``precision.mode`` means for parameters, inputs, autocast and the gradient compression
(``policy``), and loss scaling around the engine's step with the ``Precision`` the step takes (``scaler``).

May import: config, errors.
"""
