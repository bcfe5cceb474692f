# Two commands do all the set-up on a fresh machine (Python >= 3.12: `python3` if it is, else python3.12/3.13 on
# PATH or under pyenv):
#   make train   -> virtualenv .venv, install moejax alone, train configs/tiny.py on the embedded corpus (8 emulated CPU devices)
#   make test    -> the same .venv plus the test and hf extras; the suite on the emulated 8-device mesh, slow tests left out
# CI (.ci/run) runs `make test SLOW=1` (the whole suite, slow tests included, one session), `make test-gpu` (the
# deviceless GPU compiles with the gpu extra, and the files whose results differ between jax releases, on the jax
# the gpu extra resolves) and `make bench-smoke`; docs/testing.md says what each runs.
PY ?= $(shell for p in python3 python3.12 python3.13 $$HOME/.pyenv/versions/3.12*/bin/python $$HOME/.pyenv/versions/3.13*/bin/python; do "$$p" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
VENV ?= .venv
VENV_GPU ?= .venv-gpu
VENV_TE ?= .venv-te
WORKDIR ?= runs/tiny
CONFIG ?= configs/tiny.py
CPU_MESH = XLA_FLAGS="$${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
# pytest's arguments for every suite target: two workers, the slowest tests listed; BUDGET (seconds) fails the run
# when a test not marked slow takes longer (.ci/run sets it); SLOW=1 adds the tests marked slow.
PYTEST = -m pytest -n 2 --durations=20 -p no:cacheprovider $(if $(BUDGET),--budget $(BUDGET)) $(if $(filter 1,$(SLOW)),--slow)

# A virtualenv of an older Python (this project supported 3.11 before) is made anew, not installed over.
MAKE_VENV = $(1)/bin/python -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null || $(PY) -m venv --clear $(1)
NEED_PY = @test -n "$(PY)" || { echo "make: moejax needs Python >= 3.12 and none was found; set PY=/path/to/python3.12" >&2; exit 2; }

# One virtualenv, two stamps: `make train` installs moejax and what training needs (no torch, no test tools);
# `make test` adds the test tools and the Hugging Face reference implementations on top of it.
$(VENV)/.installed: pyproject.toml
	$(NEED_PY)
	$(call MAKE_VENV,$(VENV))
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e .
	touch $@

# torch is the reference implementation of the transformers comparisons; PyPI's torch for Linux is a CUDA build
# (about 3 GB of wheels with its NVIDIA libraries; it runs on the CPU).
# lm-eval (the eval extra): tests/test_lm_eval.py runs the harness end to end; pyarrow (data): parquet and arrow input;
# megatron-core (megatron): the reference writer of Megatron indexed datasets.
$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(VENV)/bin/python -m pip install -q -e '.[test,hf,eval,data,megatron]'
	touch $@

# The gpu extra (jax's CUDA plugin and tokamax: about 3.5 GB of wheels; no GPU or driver needed) for the
# deviceless GPU compiles. Its CUDA plugin can hold jax below the newest release (jax[cuda12] stops at 0.12.0.1):
# what it resolves is the oldest jax CI tests, the floor in pyproject.toml.
$(VENV_GPU)/.installed: pyproject.toml
	$(NEED_PY)
	$(call MAKE_VENV,$(@D))
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q -e '.[gpu,test]'
	touch $@

# NVIDIA Transformer Engine (kernels.expert_gemm=te) in its own virtualenv: the `te` extra (jax's CUDA 13 plugin,
# tokamax, TE's CUDA 13 core library and what its build needs), then TE's JAX extension, which PyPI has only as
# source: built against the CUDA wheels' headers (NVTE_BUILD_USE_NVIDIA_WHEELS=1; no nvcc, no GPU), at the version of
# the core library installed; about 5 minutes of one core and 2.5 GB of memory the first time, then pip's cache.
$(VENV_TE)/.installed: pyproject.toml
	$(NEED_PY)
	$(call MAKE_VENV,$(@D))
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q -e '.[te,test]'
	NVTE_BUILD_USE_NVIDIA_WHEELS=1 $(@D)/bin/python -m pip install -q --no-build-isolation --no-deps \
		"transformer-engine-jax==$$($(@D)/bin/python -c 'import importlib.metadata as m; print(m.version("transformer-engine-cu13"))')"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-gpu: $(VENV_GPU)/.installed
install-te: $(VENV_TE)/.installed

# Then a look at what it learned: text continuing the start of two held-out documents, sampled (temperature 0.7,
# top-k 20: greedy decoding of a model this small repeats itself).
train: $(VENV)/.installed
	$(CPU_MESH) $(VENV)/bin/moejax-train --config $(CONFIG) --workdir $(WORKDIR)
	$(CPU_MESH) $(VENV)/bin/moejax-generate $(WORKDIR) --corpus_prompts 2 --max_new_tokens 96 --temperature 0.7 --top_k 20 --seed 1

test: $(VENV)/.installed-test
	@$(VENV)/bin/python -c "import jax, flax, sys; print('suite on Python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__)"
	$(VENV)/bin/python $(PYTEST) tests

# Marker selections of the slow tests, for working on them.
test-fp8: $(VENV)/.installed-test
	$(VENV)/bin/python $(PYTEST) --slow -m fp8_training tests/test_fp8_training.py

test-pipeline: $(VENV)/.installed-test
	$(VENV)/bin/python $(PYTEST) --slow -m pipeline_step tests/test_pipeline.py tests/test_pipeline_step.py

# The deviceless GPU compiles (MOEJAX_GPU_COMPILE=1 turns a missing gpu extra into a failure), tokamax's kernels
# through moejax, and the files whose results differ between the jax releases CI tests (docs/testing.md), on the
# gpu extra's jax. The tests that read one compile form one class (--dist loadscope: a class goes to one worker), so
# no compile runs twice; the classes come longest compile first and keep that order (--no-loadscope-reorder: xdist
# would put the scopes with the most tests first), so two workers finish together.
GPU_EXTRA_TESTS = tests/test_gpu_compile.py tests/test_tokamax_kernels.py \
	tests/test_moe_parallel.py::test_dropless_through_tokamax_matches_dense_reference \
	tests/test_gpu_check.py::test_autotune_writes_a_cache_a_later_run_loads
VERSION_FILES = tests/test_fp8.py tests/test_planner_context.py
test-gpu: $(VENV_GPU)/.installed
	@$(VENV_GPU)/bin/python -c "import jax, flax, sys; print('gpu extra on Python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__)"
	MOEJAX_GPU_COMPILE=1 JAX_PLATFORMS=cpu $(VENV_GPU)/bin/python $(PYTEST) --slow --dist loadscope --no-loadscope-reorder \
		$(GPU_EXTRA_TESTS) $(VERSION_FILES)

# Transformer Engine's grouped GEMM in the deviceless GB300 / H200 compiles (tests/test_te_compile.py; it fails
# rather than skips without TE here) and on CPU, in the TE virtualenv. Not in CI: building TE takes longer than CI's
# budget leaves (docs/testing.md).
test-te: $(VENV_TE)/.installed
	MOEJAX_TE_COMPILE=1 MOEJAX_GPU_COMPILE=1 JAX_PLATFORMS=cpu $(VENV_TE)/bin/python $(PYTEST) --slow \
		tests/test_te_compile.py tests/test_te_gemm.py

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/train_step.py --config $(CONFIG)

# benchmarks/gpu_check.sh (the prepared one-GPU measurement) at toy shapes on one CPU device: the same scripts and
# code paths, with tokamax so that its autotuning path runs too. CI runs it.
bench-smoke: $(VENV_GPU)/.installed
	PYTHON=$(VENV_GPU)/bin/python bash benchmarks/gpu_check.sh --smoke

.PHONY: install install-test install-gpu install-te train test test-fp8 test-pipeline test-gpu test-te bench bench-smoke
