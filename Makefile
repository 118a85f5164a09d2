# Two commands on a fresh machine with Python 3.11+ and pip:
#   make train   the main job: trains the digits classifier (examples/digits.py)
#   make test    the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: train test bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python examples/digits.py $(ARGS)

# Two workers, one file each at a time (module fixtures compile once).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile

# Every benchmark, then BENCHMARKS.md rewritten from the results.
bench: $(STAMP)
	$(BIN)/python benchmarks/suite.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
