# The two commands of the README, each doing its own set-up in a virtualenv:
#   make demo   - build, install and run examples/scaling.py on this machine
#   make test   - build, install and run the test suite (and ruff)
# PYTHON picks the interpreter, VENV the environment, JAX the jax requirement.

PYTHON ?= python3
VENV ?= .venv
JAX ?= jax>=0.10.2
PIP = $(VENV)/bin/python -m pip
# CUDA=ON builds jaxoverlap._cuda (needs nvcc; installs the NCCL/cuBLAS wheels it links,
# and the cuobjdump + nvdisasm wheels its compile-check test reads). Default: ON when nvcc is on PATH.
CUDA ?= $(shell command -v nvcc >/dev/null 2>&1 && echo ON || echo OFF)
CUDA_PKGS_ON = nvidia-nccl-cu13 nvidia-cublas nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
SOURCES := pyproject.toml CMakeLists.txt $(shell find cpp -type f 2>/dev/null)

.PHONY: demo test install clean

demo: $(VENV)/.installed
	$(VENV)/bin/python examples/scaling.py

test: $(VENV)/.installed
	$(VENV)/bin/python -m ruff check jaxoverlap tests examples
	JAXOVERLAP_REQUIRE_CUDA=$(if $(filter ON,$(CUDA)),1,0) $(VENV)/bin/python -m pytest -q

install: $(VENV)/.installed

$(VENV)/.installed: $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(JAX)" numpy scipy-openblas32 scikit-build-core nanobind \
		pytest ruff flax optax matplotlib rich
	$(if $(filter ON,$(CUDA)),$(PIP) install -q $(CUDA_PKGS_ON))
	CMAKE_ARGS="-DJAXOVERLAP_CUDA=$(CUDA)" $(PIP) install -q --no-build-isolation -e .
	touch $@

clean:
	rm -rf build .venv .venv-* .pytest_cache
