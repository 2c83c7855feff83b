"""hybridtrain: Horovod data-parallel ResNet training with the hybrid (AdaBound warmup -> LARS-SGD) optimizer."""

__version__ = "0.1.0"
