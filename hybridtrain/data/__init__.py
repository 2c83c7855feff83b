"""Datasets and input pipelines."""
