# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 is pinned in the extras: it resolves to the local CPU wheel, never a multi-GB CUDA build.
	$(PY) -m pip install -q -e ".[all]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

.PHONY: install demo test lint bench-overhead
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/servopt demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
