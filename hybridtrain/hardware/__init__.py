"""What this node's GPUs and driver can run, nothing distributed: the checks a rank makes before it trains
(``checks``) and the GPU and driver facts they share with the install's plan (``gpus``; install/plan.py).
docs/hardware.md is the table, with its sources.

May import: errors. Imported by engine (the rank's checks) and the install's plan.
"""
