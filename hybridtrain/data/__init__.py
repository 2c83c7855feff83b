"""Datasets and input pipelines.

May import: distributed, config, errors (``prepare/``: the offline tools above).
"""
