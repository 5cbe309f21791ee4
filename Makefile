# `make test` sets itself up: a fresh machine needs only python3 (>= 3.10) and the package registry.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HASH := $(shell sha256sum pyproject.toml | cut -c1-12)
FULL := $(VENV)/.installed-full-$(HASH)
CORE := $(VENV)/.installed-core-$(HASH)
# A second venv with the light install only (no vllm, no torch): tests/core and tests/cli must pass there.
LIGHT_VENV ?= .venv-light
LIGHT_BIN := $(LIGHT_VENV)/bin
LIGHT := $(LIGHT_VENV)/.installed-light-$(HASH)
SHIPPED := profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet
RESULTS := benchmarks/results/h200/2026-11-30-morning
DEMO_OUT ?= out/demo

.PHONY: test test-light install demo bench examples clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip

# Tests need the vllm extra: they compare against the installed vLLM's own code (~3.5 min, ~9.4 GB).
$(FULL): pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[dev,vllm]'
	touch $(FULL) $(CORE)

# inspect/diff need only the light core (no torch, no vllm).
$(CORE): pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(CORE)

$(LIGHT_VENV)/bin/python:
	$(PYTHON) -m venv $(LIGHT_VENV)
	$(LIGHT_BIN)/python -m pip install -q -U pip

$(LIGHT): pyproject.toml | $(LIGHT_VENV)/bin/python
	$(LIGHT_BIN)/python -m pip install -q -e '.[dev]'
	touch $(LIGHT)

install: $(FULL)

# The house's import contracts (pyproject.toml, import-linter), then the light install's tests (what a
# user of inspect/diff/check/validate gets), in a venv that must not have vllm.
test-light: $(LIGHT)
	$(LIGHT_BIN)/lint-imports
	$(LIGHT_BIN)/python -c "import importlib.util as u, sys; sys.exit('vllm is installed in $(LIGHT_VENV)' if u.find_spec('vllm') else 0)"
	$(LIGHT_BIN)/python -m pytest -q tests/core tests/cli

# Light first (no vllm), then everything with vllm.
test: test-light $(FULL)
	$(BIN)/python -m pytest -q

# The README's main job: review the shipped H200 tables (no GPU needed, seconds once installed).
# --plot does not create directories (a typo must not grow a tree): make DEMO_OUT first.
# check exits 3 when a table loads if the keys only the running engine knows match (the first check
# gives the serve flags, not the attention backends or CUDA/torch builds), 1 when no table fits
# (the second, an H100 engine).
demo: $(CORE)
	mkdir -p $(DEMO_OUT)
	$(BIN)/dspark-calib inspect $(SHIPPED) --context-len 8192 --plot $(DEMO_OUT)/h200-tp1.png
	$(BIN)/dspark-calib diff $(SHIPPED) $(SHIPPED) --old-context 1024 --new-context 16384 --plot $(DEMO_OUT)/ctx1024-vs-ctx16384.svg
	$(BIN)/dspark-calib diff $(RESULTS)/h200-tp1-ctx8192-a.parquet $(RESULTS)/h200-tp1-ctx8192-b.parquet --significance --plot $(DEMO_OUT)/stability-a-vs-b.png
	$(BIN)/dspark-calib check profiles/h200 --gpu-name "NVIDIA H200" --engine gpu_memory_mib=143155 --vllm-version 0.33.0 -- \
	  profiles/configs/qwen3-8b --speculative-config '{"method": "dspark", "model": "profiles/configs/dspark-qwen3-8b-block7", "num_speculative_tokens": 7, "enable_adaptive_verification": true}' \
	  --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 32768; test $$? -eq 3
	$(BIN)/dspark-calib check profiles/h200 --gpu-name "NVIDIA H100"; test $$? -eq 1
	@echo "plots in $(DEMO_OUT)/"

# Every `$ dspark-calib` example of README.md and docs/ run again; EXAMPLES=--write rewrites them.
examples: $(CORE)
	$(BIN)/python docs/examples.py $(EXAMPLES)

bench: $(CORE)
	$(BIN)/python benchmarks/micro/bench_table.py

clean:
	rm -rf $(VENV) $(LIGHT_VENV) build dist *.egg-info out
