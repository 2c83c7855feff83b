"""What this node's GPUs and driver can run, nothing distributed: the torch build ``install.sh`` installs
(``install_plan``, run with the system Python), the checks a rank makes before it trains (``checks``), and the GPU
and driver facts both read (``gpus``). docs/hardware.md is the table, with its sources.

May import: errors. Imported by engine (the rank's checks), gpucheck and install.sh.
"""
