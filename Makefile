# Two commands on a fresh machine: `make course` (run every notebook) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Nothing is downloaded at run time: models come from configs, data is generated.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONPATH := $(CURDIR)/code
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup course test lab clean

setup: $(VENV)/.installed

# Rebuilt whenever the pins change.
$(VENV)/.installed: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

course: setup
	$(BIN)/python -m distkit.run_course

test: setup
	$(BIN)/python -m pytest

lab: setup
	$(BIN)/jupyter lab --ip 127.0.0.1 --notebook-dir notebooks

clean:
	rm -rf build .pytest_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
