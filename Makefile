# One command each: `make demo` sets up and runs the pipeline on the built-in tiny model;
# `make test` sets up and runs the test suite. TORCH pins the CPU build this machine has on
# disk; on a GPU machine install torch first and pass TORCH=torch.
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEMO ?= demo
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: setup setup-test demo test gpu-check gpu-wheels

setup:
	$(PIP) "$(TORCH)" -e .

setup-test:
	$(PIP) "$(TORCH)" -e ".[test]"

# The whole pipeline on the built-in tiny Qwen3-MoE: make it, convert it, calibrate it on 2
# expert-parallel CPU processes (NVFP4 weights, FP8 KV cache), export and check the export.
demo: setup
	$(PYTHON) tools/make_tiny.py qwen3_moe $(DEMO)/hf --overwrite
	$(PYTHON) tools/convert_hf.py $(DEMO)/hf $(DEMO)/ckpt --overwrite
	$(PYTHON) -m torch.distributed.run --nproc-per-node 2 tools/ptq.py $(DEMO)/ckpt --recipe nvfp4 \
		--kv-cache fp8 --calib-size 16 --seq-len 128 --preview --out $(DEMO)/ptq --overwrite
	$(PYTHON) tools/export_hf.py $(DEMO)/ptq $(DEMO)/export --overwrite
	$(PYTHON) tools/check_export.py $(DEMO)/export

test: setup-test
	$(PYTHON) -m pytest -q tests

# The prepared GPU check (docs/gpu-check.md): CUDA tests and GPU benchmarks in under 8 minutes,
# figures in $$OUT/gpu-check.json (else ./gpu-check.json). Installs eprt and the wheels of
# wheels/ it needs into $(PYTHON) itself, without network. Without CUDA: the parts a CPU can run.
gpu-check:
	$(PYTHON) bench/gpu_check.py

# On a networked machine: fill wheels/ with what the GPU machine lacks (CPython 3.12, x86-64).
gpu-wheels:
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels -r bench/gpu_wheels.txt
