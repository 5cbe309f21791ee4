# `make test` sets itself up: a fresh machine needs only python3 (>= 3.10) and the package registry.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: test install demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	$(BIN)/python -m pip install -q -e '.[dev,vllm]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	bash benchmarks/demo.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_table.py

clean:
	rm -rf $(VENV) build dist *.egg-info
