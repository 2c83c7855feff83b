"""Datasets and input pipelines.

May import: precision, distributed, config, errors (``prepare/``: the offline tools above).
"""
