# Two commands do all the set-up on a fresh machine with Python 3.11+:
#   make train   -> virtualenv, install moejax alone, train configs/tiny.py on the embedded corpus (8 emulated CPU devices)
#   make test    -> the same virtualenv plus the test and hf extras (CPU torch), run the suite on the emulated 8-device mesh
# CI also runs `make test-newest`: the suite on the newest jax, which needs Python >= 3.12 (PY_NEWEST), and
# `make test-gpu`: the training step compiled for 8 H200s with XLA:GPU (no GPU needed), asserted on, and
# `make test-fp8`: FP8 training (mesh = one device, resume, DeepSeek-V3-small 60 steps bf16 vs blockwise FP8 within 4%),
# `make test-pipeline`: pipelined training steps (PP 2/4 x VP 1/2) equal to one device, checkpoints across stage counts.
PY ?= python3
VENV ?= .venv
PY_NEWEST ?= $(shell for p in python3.13 python3.12 $$HOME/.pyenv/versions/3.12*/bin/python; do "$$p" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
VENV_NEWEST ?= .venv-newest
VENV_GPU ?= .venv-gpu
WORKDIR ?= runs/tiny
CONFIG ?= configs/tiny.py
CPU_MESH = XLA_FLAGS="$${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"

# One virtualenv, two stamps: `make train` installs moejax and what training needs (no torch, no test tools);
# `make test` adds the test tools and the Hugging Face reference implementations on top of it.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e .
	touch $@

# A CPU build of torch first (the tests only need it on CPU; this machine image ships 2.13.0's wheel, and an
# unconstrained resolve would pull a multi-GB CUDA build). Any torch>=2.4 works.
$(VENV)/.installed-test: $(VENV)/.installed
	$(VENV)/bin/python -m pip install -q 'torch==2.13.0' || $(VENV)/bin/python -m pip install -q 'torch>=2.4'
	$(VENV)/bin/python -m pip install -q -e '.[test,hf]'
	touch $@

# Python >= 3.12 virtualenvs. $(VENV_NEWEST): the newest jax/flax a fresh `pip install` gets; torch has no CPU
# wheel on this machine for 3.12 and PyPI's is a multi-GB CUDA build, so the `hf` extra is left out (the
# transformers comparisons skip there and run in `make test`). $(VENV_GPU): the deviceless GPU compile (XLA:GPU
# through jax's CUDA plugin, tokamax kernels), the `gpu` extra: about 3.5 GB of wheels; no GPU or driver needed.
$(VENV_NEWEST)/.installed: EXTRAS = test
$(VENV_GPU)/.installed: EXTRAS = gpu,test
$(VENV_NEWEST)/.installed $(VENV_GPU)/.installed: pyproject.toml
	@test -n "$(PY_NEWEST)" || { echo "make: $(@D) needs Python >= 3.12 and none was found; set PY_NEWEST=/path/to/python3.12" >&2; exit 2; }
	$(PY_NEWEST) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(CPU_MESH) $(VENV)/bin/moejax-train --config $(CONFIG) --workdir $(WORKDIR)

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -n 2 tests

test-newest: $(VENV_NEWEST)/.installed
	$(VENV_NEWEST)/bin/python -c "import jax, flax; print('newest: jax', jax.__version__, 'flax', flax.__version__)"
	$(VENV_NEWEST)/bin/python -m pytest -n 2 tests

test-gpu: $(VENV_GPU)/.installed
	MOEJAX_GPU_COMPILE=1 JAX_PLATFORMS=cpu $(VENV_GPU)/bin/python -m pytest -q -n 2 --dist loadgroup tests/test_gpu_compile.py

test-fp8: $(VENV)/.installed-test
	MOEJAX_FP8_TRAINING=1 $(VENV)/bin/python -m pytest -n 2 -q tests/test_fp8_training.py

test-pipeline: $(VENV)/.installed-test
	MOEJAX_PIPELINE_STEP=1 $(VENV)/bin/python -m pytest -n 2 -q -m pipeline_step tests/test_pipeline.py tests/test_pipeline_step.py

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/train_step.py --config $(CONFIG)

.PHONY: install train test test-newest test-gpu test-fp8 test-pipeline bench
