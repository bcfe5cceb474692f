#!/usr/bin/env bash
# One prepared GPU check for the day a GPU is lent: the DeepSeek-V3 layer slice and the kernel benchmarks on one
# NVIDIA GPU (sized for an H200), each under a timeout (they sum to 930 s; on an H200 on 2026-12-04 the first five
# took 281 s), most important first: an outer limit (the device tool's timeout_s) cuts the last. ONLY="NAME ..."
# runs a subset. Prints the rows for benchmarks/RESULTS.md last.
#
#   bash benchmarks/gpu_check.sh [WHEELS_DIR]          # WHEELS_DIR, else $MOEJAX_WHEELS, else .whl
#   bash benchmarks/gpu_check.sh --download-wheels DIR # on a machine with pip's index: fetch those wheels
#
# What the device machine (workplace image 'cuda', see /work/.library/device/KINDS.md) must already have, since
# it cannot be carried (64 MiB per call, working tree included): python3 3.12 with jax + a CUDA plugin (the image
# has jax 0.11.2 with jax-cuda13-plugin; jax[cuda12] as the repo's `gpu` extra names it is jaxlib ~80 MB plus
# GBs of nvidia-* wheels), flax, optax, numpy, absl-py, pyyaml, tqdm, jaxtyping, protobuf, six. The script does
# NOT pip-install the repo (no index there): moejax runs from the working tree on PYTHONPATH. If jax sees no
# GPU the script stops (exit 3) rather than install jax.
# What is carried as wheels (~6 MB, CPython 3.12, x86-64; installed with --no-deps into /tmp/moejax-site only
# when some of them cannot be imported): tokamax 0.0.17 and the modules it imports that the image lacks
# (pydantic + pydantic_core + annotated_types + typing_inspection + typing_extensions, qwix, einshape,
# immutabledict, fire + termcolor), and ml_collections and flax 0.12.12 (the version the `gpu` extra tests; it takes
# precedence over the image's flax on PYTHONPATH) for moejax. tokamax imports xprof at import time only for
# its own benchmarking helper, never called here; xprof's wheel is 32 MB, so a stub module stands in for it
# unless an xprof wheel is in the directory (it fits: ~38 MB with the rest).
#
# With the device tool, from the repo root here:
#   echo /.whl/ >> .git/info/exclude                 # once: the wheel folder travels only as a carried path
#   bash benchmarks/gpu_check.sh --download-wheels .whl
#   run(command="bash benchmarks/gpu_check.sh .whl", carry=[".whl"], timeout_s=590)
# The JSON, the log and the RESULTS.md rows are written to $OUT (the tool returns them; 10 files: the tool returns 8,
# so some are left out when everything ran: run a subset with ONLY, the rows are printed too), else to
# benchmarks/results/gpu_check/. Copy the printed rows into benchmarks/RESULTS.md. Timeouts per run can be
# changed with T_LAYER (120 s), T_LAYER_FP8 (90 s, each of the capacity bf16 / FP8 slices), T_KERNELS (150 s,
# each of the two kernel runs), T_FP8_GEMM (90 s) and T_TRAIN_STEP (150 s).
#
# Exit codes: 0 all runs ok; 1 some run failed or timed out; 2 no NVIDIA GPU; 3 jax sees no GPU or moejax's
# imports are missing.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

# Pinned: the versions .venv-gpu runs (pip install -e '.[gpu,test]'), minus what the device image has.
WHEEL_PINS=(tokamax==0.0.17 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
            typing_extensions==4.16.0 einshape==1.0 immutabledict==4.3.1 qwix==0.1.8 fire==0.7.1 termcolor==3.3.0
            ml_collections==1.1.0 flax==0.12.12)
NEEDED_MODULES="tokamax ml_collections pydantic qwix einshape immutabledict fire termcolor"

if [[ "${1:-}" == "--download-wheels" ]]; then
    dir="${2:?usage: gpu_check.sh --download-wheels DIR}"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${WHEEL_PINS[@]}" || exit 1
    du -sh "$dir"
    exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU: nvidia-smi not found" >&2
    exit 2
fi
if ! gpu_line="$(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader)" \
        || [[ -z "$gpu_line" ]]; then
    echo "gpu_check: no NVIDIA GPU: nvidia-smi found no device" >&2
    exit 2
fi

WHEELS="${1:-${MOEJAX_WHEELS:-.whl}}"
PY="${PYTHON:-python3}"
SITE=/tmp/moejax-site
DEST="${OUT:-benchmarks/results/gpu_check}"
T_LAYER="${T_LAYER:-120}"
T_KERNELS="${T_KERNELS:-150}"
T_FP8_GEMM="${T_FP8_GEMM:-90}"
T_TRAIN_STEP="${T_TRAIN_STEP:-150}"
ONLY="${ONLY:-}"  # space-separated run names (deepseek_layer ... train_step): run only those
T_LAYER_FP8="${T_LAYER_FP8:-90}"
mkdir -p "$DEST"
exec > >(tee "$DEST/gpu_check.log") 2>&1
TEE_PID=$!
trap 'exec 1>&- 2>&-; wait "$TEE_PID"' EXIT  # let tee write the last lines before the script returns
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check $(date -u +%FT%TZ): $gpu_line"

missing() {  # the modules of NEEDED_MODULES that $PY cannot import, space-separated
    "$PY" - $NEEDED_MODULES <<'EOF'
import importlib, sys
bad = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception:
        bad.append(m)
print(" ".join(bad))
EOF
}

need="$(missing)"
if [[ -n "$need" ]]; then
    echo "not importable: $need; installing the wheels in $WHEELS into $SITE"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl || echo "gpu_check: pip install from $WHEELS failed"
    else
        echo "gpu_check: no wheels in '$WHEELS' (see this script's header: --download-wheels, carry)"
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
    if ! "$PY" -c "import xprof" 2>/dev/null; then  # tokamax imports it for its benchmarking helper alone
        mkdir -p "$SITE/xprof/cli"
        touch "$SITE/xprof/__init__.py" "$SITE/xprof/cli/__init__.py"
        cat > "$SITE/xprof/cli/tools.py" <<'EOF'
"""Stub written by benchmarks/gpu_check.sh: tokamax imports xprof for its own benchmarking helper only."""


def get_kernel_stats_tool(*args, **kwargs):
    raise RuntimeError("xprof stub (benchmarks/gpu_check.sh): carry the xprof wheel to use tokamax.benchmark")
EOF
        echo "xprof: stub module in $SITE (tokamax's benchmarking helper is not used here)"
    fi
    need="$(missing)"
    [[ -n "$need" ]] && echo "still not importable: $need"
fi
if [[ " $need " == *" ml_collections "* ]]; then
    echo "gpu_check: moejax cannot import ml_collections; carry its wheel (header of this script)" >&2
    exit 3
fi

if ! "$PY" - <<'EOF'
import importlib.metadata as md, platform, sys
import jax
def v(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return "not installed"
d = jax.devices()
print(f"python {platform.python_version()} ({sys.executable}); jax {jax.__version__}, jaxlib {v('jaxlib')}, "
      f"flax {v('flax')}, tokamax {v('tokamax')}")
print(f"devices: {len(d)} x {d[0].device_kind} ({d[0].platform})")
sys.exit(0 if d[0].platform == "gpu" else 1)
EOF
then
    echo "gpu_check: jax sees no GPU; the device image must bring jax with a CUDA plugin (too large to carry)" >&2
    exit 3
fi
[[ " $need " == *" tokamax "* ]] && echo "WARNING: no tokamax: its kernels will be reported as refused"

failed=0
run() {  # run NAME SECONDS CMD...: CMD under a timeout, its exit status reported
    local name=$1 secs=$2 rc
    shift 2
    [[ -z "$ONLY" || " $ONLY " == *" $name "* ]] || return 0
    echo
    echo "=== $name (timeout ${secs}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@"
    rc=$?
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "=== $name: TIMED OUT after ${secs}s"
    else
        echo "=== $name: exit $rc after $((SECONDS - t0))s"
    fi
    [[ $rc -eq 0 ]] || failed=1
}

# In order of what matters most, so that an outer limit cuts the least useful runs. Each writes its JSON at once.
# 1. the full-width layer slice, auto kernels (tokamax_mosaic attention, tokamax dropless grouped GEMM)
run deepseek_layer "$T_LAYER" "$PY" benchmarks/deepseek_layer.py --dtype bfloat16 --tokens 4096 --seq 4096 \
    --steps 10 --json "$DEST/deepseek_layer.json"
# 2. the same slice with capacity dispatch (batched einsum GEMMs, capacity 1.25), in bf16 and in DeepSeek-V3's
#    blockwise and rowwise FP8 (Hopper): dropless vs capacity, and FP8 vs bf16 on the same GEMMs; the JSON lists the
#    compiled program's GEMM calls (__cublas$lt$matmul$f8: an FP8 GEMM)
run deepseek_layer_capacity "$T_LAYER_FP8" "$PY" benchmarks/deepseek_layer.py --dtype bfloat16 --tokens 4096 \
    --seq 4096 --steps 10 --dispatch capacity --json "$DEST/deepseek_layer_capacity.json"
run deepseek_layer_fp8 "$T_LAYER_FP8" "$PY" benchmarks/deepseek_layer.py --dtype bfloat16 --tokens 4096 \
    --seq 4096 --steps 10 --dispatch capacity --fp8 blockwise --json "$DEST/deepseek_layer_fp8.json"
run deepseek_layer_fp8_rowwise "$T_LAYER_FP8" "$PY" benchmarks/deepseek_layer.py --dtype bfloat16 --tokens 4096 \
    --seq 4096 --steps 10 --dispatch capacity --fp8 rowwise --json "$DEST/deepseek_layer_fp8_rowwise.json"
# 3. flash attention + grouped GEMM by tokamax (what `auto` picks on GPU)
run kernels_tokamax "$T_KERNELS" "$PY" benchmarks/kernels.py --expert_gemm tokamax --attention tokamax_mosaic \
    --json "$DEST/kernels_tokamax.json"
# 4. the alternatives: einsum capacity GEMM (ragged_dot is refused on GPU: XLA densifies it), tokamax's Triton
#    flash attention, XLA's reference attention; cuDNN attention is listed to record its refusal: jax's cuDNN
#    fused attention takes head dims <= 128, MLA's q/k head dim is 192.
run kernels_alternatives "$T_KERNELS" "$PY" benchmarks/kernels.py --expert_gemm einsum,ragged_dot \
    --attention tokamax_triton,xla,cudnn --json "$DEST/kernels_alternatives.json"
# 5. one GEMM fwd+bwd in bf16, blockwise FP8 and rowwise FP8 (benchmarks/fp8_gemm.py)
run fp8_gemm "$T_FP8_GEMM" "$PY" benchmarks/fp8_gemm.py --json "$DEST/fp8_gemm.json"
# 6. the whole jitted training step (loss, optimizer, both dispatch modes) of the small DeepSeek-V3-shaped benchmark
#    config on this one GPU: that it compiles and runs; the model is too small for its MFU to mean much
run train_step "$T_TRAIN_STEP" "$PY" benchmarks/train_step.py --config benchmarks/configs/deepseek_v3_step.py \
    --layouts data8 --dispatches capacity,dropless --steps 5 --dtype bfloat16 --json "$DEST/train_step.json"

echo
echo "=== rows for benchmarks/RESULTS.md (| date | GPU | command | metric | value |):"
jsons=()
for f in "$DEST"/deepseek_layer.json "$DEST"/deepseek_layer_capacity.json "$DEST"/deepseek_layer_fp8.json \
         "$DEST"/deepseek_layer_fp8_rowwise.json \
         "$DEST"/kernels_tokamax.json "$DEST"/kernels_alternatives.json "$DEST"/fp8_gemm.json \
         "$DEST"/train_step.json; do
    [[ -s "$f" ]] && jsons+=("$f")
done
if [[ ${#jsons[@]} -gt 0 ]]; then
    "$PY" benchmarks/kernels.py --results_rows "${jsons[@]}" | tee "$DEST/results_rows.md"
else
    echo "(no run wrote JSON)"
fi
echo "gpu_check: $([[ $failed -eq 0 ]] && echo "all runs ok" || echo "some run failed or timed out"); files in $DEST"
exit $failed
