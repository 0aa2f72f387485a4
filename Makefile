# One-command setup: a virtual environment with the package (editable) and its dev tools.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/grpo-cli analyze sample_data/rollouts.parquet

test: $(STAMP)
	$(BIN)/ruff check grpo_cli tests bench
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check grpo_cli tests bench

bench: $(STAMP)
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
