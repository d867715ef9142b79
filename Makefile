# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install exactly the locked set
# (requirements-lock.txt: every package pinned with its hashes), then servopt itself editable, without dependencies.
# `make lock` refreshes the lock after a change to pyproject.toml; `make lock-upgrade` moves every pin to the newest
# release (then run `make test`). How and when: docs/lock.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements-lock.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)
# pip-compile runs from an environment of its own, outside the work tree (it is not part of the locked set).
LOCK_TOOLS ?= $(HOME)/.cache/servopt/lock-tools
LOCK_TOOLS_REQ := pip-tools==7.6.2 pip==26.3
# torch==2.13.0+cpu is on no plain index: pip finds it through its find-links (/opt/wheels on our machines). Elsewhere
# name PyTorch's CPU wheel index, set here only: `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu` (or in
# the environment); it reaches pip and pip-compile as --extra-index-url, and nothing is added when it is unset.
TORCH_INDEX ?=
INDEX_FLAGS := $(if $(strip $(TORCH_INDEX)),--extra-index-url $(strip $(TORCH_INDEX)))
# --unsafe-package servopt: the `all` extra names servopt[...] itself, which is installed editable, not from the lock.
# --build-deps-for editable: setuptools (build-system.requires) is locked too; the editable install builds with it.
LOCK_FLAGS := --generate-hashes --extra all --strip-extras --build-deps-for editable --unsafe-package servopt \
	--no-emit-index-url --no-emit-find-links

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# --no-deps: nothing is resolved here, the lock is the whole set; --require-hashes: byte-identical files every time.
	# torch==2.13.0+cpu is the CPU wheel (pip's find-links, or TORCH_INDEX), never a multi-GB CUDA build.
	$(PY) -m pip install -q --require-hashes --no-deps $(INDEX_FLAGS) -r $(LOCK)
	# Packages an earlier install left that the lock no longer has (pip is the venv's own, servopt comes next).
	$(PY) -m pip freeze --all --exclude-editable | sed -n 's/^\([A-Za-z0-9._-]*\)[=@ ].*/\1/p' | tr 'A-Z_.' 'a-z--' | sort -u > $(VENV)/.have
	sed -n 's/^\([A-Za-z0-9._-]*\)==.*/\1/p' $(LOCK) | tr 'A-Z_.' 'a-z--' | sort -u > $(VENV)/.want
	comm -23 $(VENV)/.have $(VENV)/.want | grep -vx -e pip -e servopt | xargs -r $(PY) -m pip uninstall -q -y
	rm -f $(VENV)/.have $(VENV)/.want
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	rm -f $(VENV)/.installed-*
	sha256sum $(LOCK) | cut -d' ' -f1 > $(VENV)/servopt-lock.sha256
	touch $(STAMP)

.PHONY: install demo test lint lock lock-upgrade lock-tools
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/servopt demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest --durations=15  # the slowest tests, printed in every CI log: the suite must stay under 15 minutes
	# The tests whose answer follows what servopt reads of the CPU, again as on an AVX2 CPU without VNNI (the seed's
	# cpu-server class) whatever this one is: docs/hardware.md, issue 40.
	SERVOPT_CPU_READ_AS=avx2 $(PY) -m pytest -m isa
	# What an AVX2 CPU without VNNI computes, by its own kernels (qemu-user's EPYC-Milan): the model of x86's U8S8
	# kernel that servopt decides INT8 by, checked against the real thing (docs/hardware.md). Without qemu-user these
	# run only on such a CPU (skipped elsewhere).
	if command -v qemu-x86_64 >/dev/null; then benchmarks/avx2_cpu.sh $(PY) -m pytest -p no:cacheprovider -m avx2_kernels tests/test_avx2_kernels.py; \
	else echo "qemu-user not installed: tests/test_avx2_kernels.py ran only if this CPU is AVX2 without VNNI (apt-get install qemu-user)"; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

lock-tools:
	test -x $(LOCK_TOOLS)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_TOOLS) && $(LOCK_TOOLS)/bin/python -m pip install -q $(LOCK_TOOLS_REQ); }

# Keeps every pin the lock already has where pyproject still allows it; adds and removes what changed.
# One package newer: make lock LOCK_ARGS="--upgrade-package onnxruntime"
lock: lock-tools
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_TOOLS)/bin/pip-compile -q $(LOCK_FLAGS) $(INDEX_FLAGS) $(LOCK_ARGS) -o $(LOCK) pyproject.toml

lock-upgrade:
	$(MAKE) lock LOCK_ARGS="--upgrade $(LOCK_ARGS)"
