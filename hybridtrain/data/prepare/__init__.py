"""Offline dataset tools (``hybridtrain prepare-data digits|synthetic-imagenet|imagenet``, ``reorganise-val``):
they write datasets in the ImageNet folder layout that ``data`` reads (and, for imagenet, tar shards).

May import: data, config, errors.
"""
