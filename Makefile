# fsd-chat: set up a virtual environment and run the chat or the tests.
# torch is installed first and pinned: an unpinned torch pulls gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
MODELS ?= ../shared/models
TARGET ?= $(MODELS)/stories260K
DRAFT ?= $(MODELS)/stories260K-draft

SHARED ?= ../shared
# gpu-check benchmarks the CPU-scale stories260K unless a pair is given: make gpu-check TARGET=... DRAFT=...
GIVEN = $(filter command line environment,$(origin $(1)))

.PHONY: setup chat test lint gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

chat: setup
	$(BIN)/fsd-chat --target "$(TARGET)" --draft "$(DRAFT)"

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check fsd_chat tests
	$(BIN)/ruff format --check fsd_chat tests
	$(BIN)/mypy
	$(BIN)/lint-imports

gpu-check: setup
	$(BIN)/python -m fsd_chat.gpu_check --models "$(MODELS)" --builder "$(SHARED)/tools/build_scaled_target.py" \
		$(if $(call GIVEN,TARGET),--target "$(TARGET)") $(if $(call GIVEN,DRAFT),--draft "$(DRAFT)")
