# Two commands do all the set-up on a fresh machine with Python 3.11+:
#   make train   -> virtualenv, install, train configs/tiny.py on the embedded corpus (8 emulated CPU devices)
#   make test    -> virtualenv, install with test extras, run the suite on the emulated 8-device mesh
PY ?= python3
VENV ?= .venv
WORKDIR ?= runs/tiny
CONFIG ?= configs/tiny.py
CPU_MESH = XLA_FLAGS="$${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# A CPU build of torch first (the tests only need it on CPU; this machine image ships 2.13.0's wheel,
	# and an unconstrained resolve would pull a multi-GB CUDA build). Any torch>=2.4 works.
	$(VENV)/bin/python -m pip install -q 'torch==2.13.0' || $(VENV)/bin/python -m pip install -q 'torch>=2.4'
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(CPU_MESH) $(VENV)/bin/moejax-train --config $(CONFIG) --workdir $(WORKDIR)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -n 2 tests

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/train_step.py --config $(CONFIG)

.PHONY: install train test bench
