# The two README commands: `make demo` and `make test`. Both run the idempotent ./install.sh first.
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: install demo test
install:
	./install.sh

demo: install
	hybridtrain prepare-data digits --out data/digits
	horovodrun -np 2 -H localhost:2 hybridtrain train --config configs/demo.yaml --resume auto

test: install
	python -m pytest tests -q -rs
