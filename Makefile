# The two README commands: `make demo` and `make test`. Both run the idempotent ./install.sh first.
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: install install-oldest-torch demo demo-torch test gpu-bundle gpu-check gpu-rehearsal
install:
	./install.sh

# a second venv with the oldest torch the code supports (docs/hardware.md), no Horovod, no DALI: the tests run a
# smoke subset in it (tests/test_oldest_torch.py) on the torch engine; idempotent, seconds once made. It lives in
# install.sh's cache, beside the Horovod wheels, so that a fresh clone does not spend 4 minutes making it again
# (its tests put their checkout first on PYTHONPATH, whichever checkout installed it)
export HYBRIDTRAIN_OLDEST_VENV ?= $(or $(HYBRIDTRAIN_CACHE),$(HOME)/.cache/hybridtrain)/venv-oldest-torch
install-oldest-torch:
	HYBRIDTRAIN_TORCH=2.3.1 HYBRIDTRAIN_SKIP_HOROVOD=1 HYBRIDTRAIN_SKIP_DALI=1 \
		HYBRIDTRAIN_VENV=$(HYBRIDTRAIN_OLDEST_VENV) ./install.sh

demo: install
	hybridtrain prepare-data digits --out data/digits
	horovodrun -np 2 -H localhost:2 hybridtrain train --config configs/demo.yaml --resume auto

# the same demo on the torch engine (DDP under torchrun; needs no Horovod), into its own run_dir
demo-torch: install
	hybridtrain prepare-data digits --out data/digits
	torchrun --standalone --nproc-per-node=2 -m hybridtrain train --config configs/demo.yaml --engine torch \
		--set run_dir=runs/demo-torch --resume auto

# two test files at a time (pytest-xdist, a whole file per worker so that its shared runs are made once): the suite's
# multi-rank jobs leave a 2-core machine about 40% idle while they start, wait for peers and time out
TEST_WORKERS ?= 2
test: install install-oldest-torch
	# a full run writes about 13 GB of checkpoints and data under pytest's temp folder: keep only failed tests'.
	# --timeout: a test that hangs fails by name with its stack after 15 min (the slowest takes about 2.5 min)
	python -m pytest tests -q -rs --durations=25 -n $(TEST_WORKERS) --dist loadfile --timeout=900 \
		-o tmp_path_retention_policy=failed -o tmp_path_retention_count=1

# what a lent offline GPU machine lacks for the GPU check (Horovod's source and its build's wheels), in .gpu-bundle/
# beside the tree; prints its size with the tree's (docs/benchmarks.md). Needs a package registry.
gpu-bundle:
	python3 tools/gpu_bundle.py .gpu-bundle

# the GPU check (tests/gpu) on this GPU node, in one call of BUDGET seconds: the table printed and $(OUT)/gpu-check.tgz
# written whatever happens; rows that passed before are skipped (pytest's cache; EARLIER=an earlier call's archive)
OUT ?= .gpu-check
BUDGET ?= 520
gpu-check:
	PYTHONPATH=$(CURDIR) python3 -m pytest tests/gpu -q -rfEs --session-timeout $(BUDGET) --archive "$(OUT)" \
		--junitxml .gpu-check/out/junit.xml $(if $(EARLIER),--earlier "$(EARLIER)")

# the same call rehearsed on this CPU machine, the network cut but loopback: an image-like Python, Horovod built
# with NCCL from .gpu-bundle, every row's command started; exit 0 when every row got as far as its GPU step
gpu-rehearsal:
	unshare -n sh -c 'ip link set lo up && exec "$$0" "$$@"' env PYTHONPATH=$(CURDIR) python -m pytest tests/gpu \
		-q -rfEs --rehearse --gpu-out .gpu-check/rehearsal --archive .gpu-check/rehearsal \
		--junitxml .gpu-check/rehearsal/junit.xml
