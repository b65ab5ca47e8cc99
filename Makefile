# Quick start: `make demo` runs the whole stack on embedded defaults, `make test` runs the suite.
# Each target creates the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test venv stubs clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# The figure and JSON summary go to out/ (ignored by git), not the working tree.
demo: $(BIN)/.installed
	$(BIN)/llm-extproc demo --plot out/demo.png --json out/demo.json

test: $(BIN)/.installed
	$(BIN)/pytest -q

stubs: $(BIN)/.installed
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
