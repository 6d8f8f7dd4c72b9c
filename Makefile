# `make demo` and `make test` each work from a clean clone: they build .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Torch's C++ extensions (DeepSpeed's ops) build into the venv, not the shared ~/.cache: a build
# killed half-way there leaves a lock file that makes every later build, in any clone, wait for ever.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
PYTEST_ARGS ?=

.PHONY: install demo test drills lint bench clean

install: $(STAMP)

# torch: keep one that is already importable (system site packages are visible); otherwise take
# torch==2.13.0 from the configured index (a CPU wheel on this project's CI index; on PyPI, the CUDA
# build: README.md says how to take the CPU one first).
# deepspeed builds from source against that torch, so it is installed without build isolation.
$(STAMP): pyproject.toml setup.py ncclguard/recording/_hotpath.c autostart/ncclguard-autostart.pth Makefile
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -c "import deepspeed" 2>/dev/null || $(PY) -m pip install -q --no-build-isolation "deepspeed>=0.15"
	$(PY) -m pip install -q -e ".[all]"
	# Debian's fuse3 (libfuse3 for mfusepy, fusermount3) for the FUSE test of tests/watching/test_io_wait.py,
	# as root where apt-get is; never fatal: without it that test skips.
	-command -v fusermount3 >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 >/dev/null 2>&1; }; }; } || true
	# DeepSpeed's CPU accelerator compiles its shared-memory comm op (~60 s on 2 cores) on first
	# use; build it here, once, instead of inside a time-bounded test launch. A lock left by an
	# interrupted install goes with the rest of that build; the bound turns a stuck build into an error.
	rm -rf $(TORCH_EXTENSIONS_DIR)
	timeout 900 $(PY) -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ncclguard demo

# Byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set (this project's CI), each of the suite's
# hundreds of rank processes would otherwise compile ncclguard and the workers from source again.
# --no-loadscope-reorder: the files run in the order tests/conftest.py gives them (the launches of
# real ranks first); pytest-xdist's default since 3.5 reorders them by their number of tests, which
# put the launches, a few tests a file, last (the option came with 3.8).
test: $(STAMP)
	$(PY) -m compileall -q ncclguard integrations autostart tests
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q --durations=30 -m "not drill" $(PYTEST_ARGS)

# The longer variants (marked drill): each has its short form in `make test` (docs/architecture.md, "Checks").
drills: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q --durations=30 -m drill $(PYTEST_ARGS)

# ruff (lint and format) over everything we ship and test; types over the library.
lint: $(STAMP)
	$(VENV)/bin/ruff check ncclguard integrations autostart setup.py tests benchmarks docs/examples
	$(VENV)/bin/ruff format --check ncclguard integrations autostart setup.py tests benchmarks docs/examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/run_gloo_2ranks.py

clean:
	rm -rf $(VENV) build *.egg-info
