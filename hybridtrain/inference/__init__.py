"""After training: one run's trained model measured on a data set (``evaluate``), run on pictures (``classify``) and
exported for inference (``export``). ``trained`` reads the model as the trainer built and saved it.

May import: engine, data, models, precision, distributed, config, outputs, errors. Nothing of training imports it.
"""
