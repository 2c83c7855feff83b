"""What ``install.sh`` asks before it installs: the torch build this node's GPUs and driver need (``plan``, run with
the system Python: the standard library and hybridtrain.hardware.gpus only). A tool of the install, above the
trainer, beside the other tools; docs/hardware.md is the table it encodes.
"""
