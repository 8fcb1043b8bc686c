# One command each: `make demo` sets up and runs the pipeline on the built-in tiny model;
# `make test` sets up and runs the test suite. TORCH pins the CPU build this machine has on
# disk; on a GPU machine install torch first and pass TORCH=torch.
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEMO ?= demo
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: setup setup-test demo test

setup:
	$(PIP) "$(TORCH)" -e .

setup-test:
	$(PIP) "$(TORCH)" -e ".[test]"

demo: setup
	$(PYTHON) tools/make_tiny.py qwen3_moe $(DEMO)/hf --overwrite
	$(PYTHON) tools/convert_hf.py $(DEMO)/hf $(DEMO)/ckpt --overwrite
	$(PYTHON) tools/export_hf.py $(DEMO)/ckpt $(DEMO)/export --overwrite

test: setup-test
	$(PYTHON) -m pytest -q tests
