# Two commands do all the set-up on a fresh machine with Python 3.11+:
#   make train   -> virtualenv, install moejax alone, train configs/tiny.py on the embedded corpus (8 emulated CPU devices)
#   make test    -> the same virtualenv plus the test and hf extras (CPU torch), run the suite on the emulated 8-device mesh
# CI (.ci/run) also runs `make test-newest`: the suite on the newest jax (Python >= 3.12, PY_NEWEST) with the gpu
# extra, so the same session also compiles the training step for H200s and GB300s with XLA:GPU (no GPU needed)
# and asserts on it (`make test-gpu` runs those compiles alone), and `make test-slow`: FP8 training (`make test-fp8`)
# and pipelined steps (`make test-pipeline`) in one session, so two workers share both.
PY ?= python3
VENV ?= .venv
PY_NEWEST ?= $(shell for p in python3.13 python3.12 $$HOME/.pyenv/versions/3.12*/bin/python; do "$$p" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
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

# The Python >= 3.12 virtualenv: the newest jax/flax a fresh `pip install` gets, with the `gpu` extra (jax's CUDA
# plugin and tokamax: about 3.5 GB of wheels; no GPU or driver needed) for the deviceless GPU compiles. torch has no
# CPU wheel on this machine for 3.12 and PyPI's is a multi-GB CUDA build, so the `hf` extra is left out (the
# transformers comparisons skip there and run in `make test`).
$(VENV_GPU)/.installed: pyproject.toml
	@test -n "$(PY_NEWEST)" || { echo "make: $(@D) needs Python >= 3.12 and none was found; set PY_NEWEST=/path/to/python3.12" >&2; exit 2; }
	$(PY_NEWEST) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q -e '.[gpu,test]'
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(CPU_MESH) $(VENV)/bin/moejax-train --config $(CONFIG) --workdir $(WORKDIR)

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -n 2 tests

# The deviceless GPU compiles form xdist groups (one per compile), spread over the two workers with the rest.
test-newest: $(VENV_GPU)/.installed
	$(VENV_GPU)/bin/python -c "import jax, flax; print('newest: jax', jax.__version__, 'flax', flax.__version__)"
	MOEJAX_GPU_COMPILE=1 JAX_PLATFORMS=cpu $(VENV_GPU)/bin/python -m pytest -n 2 --dist loadgroup tests

test-gpu: $(VENV_GPU)/.installed
	MOEJAX_GPU_COMPILE=1 JAX_PLATFORMS=cpu $(VENV_GPU)/bin/python -m pytest -q -n 2 --dist loadgroup tests/test_gpu_compile.py \
		tests/test_tokamax_kernels.py

FP8_TRAINING = MOEJAX_FP8_TRAINING=1 $(VENV)/bin/python -m pytest -n 2 -q -m fp8_training tests/test_fp8_training.py
PIPELINE_STEP = MOEJAX_PIPELINE_STEP=1 $(VENV)/bin/python -m pytest -n 2 -q -m pipeline_step tests/test_pipeline.py tests/test_pipeline_step.py

test-fp8: $(VENV)/.installed-test
	$(FP8_TRAINING)

test-pipeline: $(VENV)/.installed-test
	$(PIPELINE_STEP)

test-slow: $(VENV)/.installed-test
	MOEJAX_FP8_TRAINING=1 MOEJAX_PIPELINE_STEP=1 $(VENV)/bin/python -m pytest -n 2 -q -m "fp8_training or pipeline_step" \
		tests/test_fp8_training.py tests/test_pipeline.py tests/test_pipeline_step.py

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/train_step.py --config $(CONFIG)

# benchmarks/gpu_check.sh (the prepared one-GPU measurement) at toy shapes on one CPU device: the same scripts and
# code paths, with the newest jax and tokamax so that its autotuning path runs too. CI runs it.
bench-smoke: $(VENV_GPU)/.installed
	PYTHON=$(VENV_GPU)/bin/python bash benchmarks/gpu_check.sh --smoke

.PHONY: install train test test-newest test-gpu test-fp8 test-pipeline test-slow bench bench-smoke
