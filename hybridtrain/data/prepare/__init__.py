"""Offline dataset tools (``hybridtrain prepare-data``, ``reorganise-val``): they write datasets in the ImageNet folder
layout that ``data`` reads.

May import: data, config, errors.
"""
