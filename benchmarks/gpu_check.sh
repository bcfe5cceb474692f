#!/usr/bin/env bash
# One prepared GPU check for the minutes a GPU is lent: the whole training step of the one-GPU DeepSeek-V3 proxy
# (benchmarks/configs/deepseek_v3_1gpu.py: DeepSeek-V3's widths, the layer and expert counts cut to fill the GPU)
# first, then the layer slice and the kernel benchmarks, in priority order, inside one budget of device time
# (BUDGET_S, 570 s: under the device tool's 600 s per command). Each run has its own timeout, cut to what the
# budget has left; a run that would get under MIN_RUN_S (45 s) is skipped and listed. Every run writes its JSON as
# it goes and its benchmarks/RESULTS.md rows are appended to results_rows.md as soon as it ends, so a run cut short
# keeps what it measured. ONLY="NAME ..." runs a subset.
#
#   bash benchmarks/gpu_check.sh [WHEELS_DIR]          # on the GPU machine; WHEELS_DIR, else $MOEJAX_WHEELS, else .whl
#   bash benchmarks/gpu_check.sh --smoke               # on a CPU: the same runs at toy shapes (CI runs this)
#   bash benchmarks/gpu_check.sh --download-wheels DIR # on a machine with pip's index: fetch those wheels
#
# Order (names for ONLY):
#   1. proxy            the proxy's step, bf16, dropless and capacity, tokamax's default kernel configs and then
#                       autotuned ones (--autotune tune: the tuned cache starts from benchmarks/tokamax_autotune/
#                       and is written to $DEST/tokamax_autotune/, to be committed back)
#   2. proxy_fp8        the same step with rowwise FP8 GEMMs (Hopper's fast recipe), capacity dispatch (FP8
#                       dropless runs the tiled einsum, whose per-tile weight copies do not fit: 185.7 GiB by
#                       XLA:GPU for the h200 variant)
#   3. deepseek_layer, kernels_tokamax, fp8_gemm, te_gemm, kernels_alternatives, deepseek_layer_capacity,
#      deepseek_layer_capacity_fp8_blockwise, deepseek_layer_capacity_fp8_rowwise: the layer slice (1 layer, 8
#      experts, full width) and the kernel benchmarks (te_gemm: Transformer Engine's grouped GEMM, bf16 and FP8)
# The proxy variant follows the GPU's memory (nvidia-smi): 'h200' from 120 GB up, else 'h100' (PROXY overrides).
#
# --smoke: no GPU, no wheels; JAX_PLATFORMS=cpu on one CPU device (the one-GPU code path) with PYTHON (default
# python3) as it is; toy shapes (the proxy's 'smoke' variant, width-scaled slices and kernels, 1 step), compiled
# without LLVM optimisation; te_gemm times TE's XLA emulation (--allow_emulation: TE cannot run on a CPU); autotune
# runs when tokamax is importable (on a CPU the step has no tokamax op: the path is exercised, nothing is tuned).
# Its files go to $OUT or benchmarks/results/gpu_check_smoke/.
#
# What the GPU machine must already have, since it cannot be carried (64 MiB per call, working tree included):
# python3 3.12 with jax + a CUDA plugin (the image
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
# unless an xprof wheel is in the directory (it fits: ~38 MB with the rest). Transformer Engine is not carried
# (about 1 GB installed): te_gemm measures it only where the image has it (NVIDIA's JAX containers do).
#
# With the device tool, from the repo root here:
#   echo /.whl/ >> .git/info/exclude                 # once: the wheel folder travels only as a carried path
#   bash benchmarks/gpu_check.sh --download-wheels .whl
#   run(command="bash benchmarks/gpu_check.sh .whl", carry=[".whl"], timeout_s=590)
# The JSON, the log, the tuned tokamax cache and the RESULTS.md rows are written to $OUT (the tool returns them),
# else to benchmarks/results/gpu_check/. Copy the rows into benchmarks/RESULTS.md and the tuned cache into
# benchmarks/tokamax_autotune/. Timeouts per run: T_PROXY (330 s), T_PROXY_FP8 (150 s), T_LAYER (60 s),
# T_KERNELS (100 s, each kernel run), T_FP8_GEMM (90 s), T_TE_GEMM (90 s), T_LAYER_FP8 (60 s, each of the other
# slices).
#
# Exit codes: 0 all runs ok; 1 some run failed, timed out or was skipped for the budget; 2 no NVIDIA GPU (not with
# --smoke); 3 jax sees no GPU (--smoke: not the CPU) or moejax's imports are missing.

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

SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then
    SMOKE=1
    shift
fi
PY="${PYTHON:-python3}"
SITE=/tmp/moejax-site
ONLY="${ONLY:-}"  # space-separated run names (proxy ... deepseek_layer_fp8_rowwise): run only those
BUDGET_S="${BUDGET_S:-570}"
MIN_RUN_S="${MIN_RUN_S:-45}"
T_PROXY="${T_PROXY:-330}"
T_PROXY_FP8="${T_PROXY_FP8:-150}"
T_LAYER="${T_LAYER:-60}"
T_KERNELS="${T_KERNELS:-100}"
T_FP8_GEMM="${T_FP8_GEMM:-90}"
T_TE_GEMM="${T_TE_GEMM:-90}"
T_LAYER_FP8="${T_LAYER_FP8:-60}"

if [[ $SMOKE -eq 1 ]]; then
    DEST="${OUT:-benchmarks/results/gpu_check_smoke}"
    gpu_line="smoke run: no GPU (JAX_PLATFORMS=cpu, one CPU device, toy shapes)"
    export JAX_PLATFORMS=cpu
    # one device (the one-GPU code path); no LLVM optimisation of the toy programs: they compile 2-3x faster
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0"
else
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "gpu_check: no NVIDIA GPU: nvidia-smi not found" >&2
        exit 2
    fi
    if ! gpu_line="$(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
            --format=csv,noheader)" || [[ -z "$gpu_line" ]]; then
        echo "gpu_check: no NVIDIA GPU: nvidia-smi found no device" >&2
        exit 2
    fi
    DEST="${OUT:-benchmarks/results/gpu_check}"
    WHEELS="${1:-${MOEJAX_WHEELS:-.whl}}"
fi
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
if [[ -n "$need" && $SMOKE -eq 0 ]]; then
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

if ! "$PY" - "$SMOKE" <<'EOF'
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
sys.exit(0 if d[0].platform == ("cpu" if sys.argv[1] == "1" else "gpu") else 1)
EOF
then
    echo "gpu_check: jax sees no GPU; the device image must bring jax with a CUDA plugin (too large to carry)" >&2
    exit 3
fi
[[ " $need " == *" tokamax "* ]] && echo "no tokamax: its kernels are reported as refused, nothing is autotuned"

# The proxy's variant: what fits the GPU's memory (nvidia-smi's memory.total, MiB).
if [[ $SMOKE -eq 1 ]]; then
    PROXY="smoke"
elif [[ -z "${PROXY:-}" ]]; then
    mem_mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -dc '0-9')"
    PROXY=$([[ "${mem_mib:-0}" -ge 114000 ]] && echo h200 || echo h100)
fi
echo "proxy: benchmarks/configs/deepseek_v3_1gpu.py:$PROXY"
# The tuned tokamax cache: the committed one (if this GPU has one) is where tuning starts; the run's goes to $DEST.
TUNED="$DEST/tokamax_autotune"
mkdir -p "$TUNED"
cp -n benchmarks/tokamax_autotune/*.json "$TUNED"/ 2>/dev/null
AUTOTUNE=(--autotune tune --autotune_cache "$TUNED/{device_kind}.json")
[[ " $need " == *" tokamax "* ]] && AUTOTUNE=(--autotune none)

START=$SECONDS
failed=0
skipped=()
ROWS="$DEST/results_rows.md"
: > "$ROWS"
run() {  # run NAME SECONDS JSON CMD...: CMD under min(SECONDS, what the budget has left); then its RESULTS.md rows
    local name=$1 secs=$2 json=$3 rc left
    shift 3
    [[ -z "$ONLY" || " $ONLY " == *" $name "* ]] || return 0
    left=$((BUDGET_S - (SECONDS - START)))
    if [[ $left -lt $MIN_RUN_S ]]; then
        echo "=== $name: SKIPPED (${left}s of the ${BUDGET_S}s budget left)"
        skipped+=("$name")
        return 0
    fi
    [[ $secs -gt $left ]] && secs=$left
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
    if [[ -s "$json" ]]; then  # also after a timeout: the runs write their JSON as they go
        "$PY" benchmarks/kernels.py --results_rows "$json" >> "$ROWS" || failed=1
    fi
}

# Shapes: the GPU's, or toy ones for --smoke (same scripts, same code paths).
if [[ $SMOKE -eq 1 ]]; then
    STEPS=(--steps 1) DTYPE=float32 MATMUL=(--matmul_n 256)
    LAYER=(--scale 0.0625 --tokens 256 --seq 128 --steps 1 --matmul_n 256)
    KERNELS=(--scale 0.0625 --tokens 256 --seq 128 --heads 8 --warmup 1 --steps 1)
    FP8_GEMM=(--m 256 --k 256 --n 128 --steps 1)
    TE_GEMM=(--g 4 --rows 1024 --k 256 --n 128 --steps 1 --allow_emulation)
else
    STEPS=(--steps 5) DTYPE=bfloat16 MATMUL=()
    # te_gemm without --allow_emulation: on a GPU a missing TE is a row saying so, not an emulated number
    LAYER=(--tokens 4096 --seq 4096 --steps 10) KERNELS=() FP8_GEMM=() TE_GEMM=()
fi
STEP_ARGS=(--config "benchmarks/configs/deepseek_v3_1gpu.py:$PROXY" --layouts config --dtype "$DTYPE" "${STEPS[@]}"
           "${MATMUL[@]}")

# 1. the proxy's whole step in bf16, dropless (tokamax grouped GEMM) and capacity (batched einsum), with tokamax's
#    default kernel configs, then autotuned
run proxy "$T_PROXY" "$DEST/proxy.json" "$PY" benchmarks/train_step.py "${STEP_ARGS[@]}" \
    --dispatches dropless,capacity --fp8 none "${AUTOTUNE[@]}" --json "$DEST/proxy.json"
# 2. the same with rowwise FP8 GEMMs (one FP8 GEMM per product on Hopper), capacity dispatch, under the tuned
#    configs when there are
LOAD=(--autotune none)
kind="$("$PY" -c 'import jax; print(jax.devices()[0].device_kind.lower().replace(" ", "_"))' 2>/dev/null)"
[[ -s "$TUNED/$kind.json" && "${AUTOTUNE[1]}" == tune ]] && LOAD=(--autotune load --autotune_cache "$TUNED/$kind.json")
run proxy_fp8 "$T_PROXY_FP8" "$DEST/proxy_fp8.json" "$PY" benchmarks/train_step.py "${STEP_ARGS[@]}" \
    --dispatches capacity --fp8 rowwise "${LOAD[@]}" --json "$DEST/proxy_fp8.json"
# 3. the full-width layer slice with the auto kernels (tokamax_mosaic attention, tokamax dropless grouped GEMM)
run deepseek_layer "$T_LAYER" "$DEST/deepseek_layer.json" "$PY" benchmarks/deepseek_layer.py --dtype "$DTYPE" \
    "${LAYER[@]}" --json "$DEST/deepseek_layer.json"
# 4. flash attention + grouped GEMM by tokamax, against one dense GEMM of equal FLOPs
run kernels_tokamax "$T_KERNELS" "$DEST/kernels_tokamax.json" "$PY" benchmarks/kernels.py --expert_gemm tokamax \
    --attention tokamax_mosaic --dtype "$DTYPE" "${KERNELS[@]}" --json "$DEST/kernels_tokamax.json"
# 5. one GEMM fwd+bwd in bf16, blockwise FP8 and rowwise FP8
run fp8_gemm "$T_FP8_GEMM" "$DEST/fp8_gemm.json" "$PY" benchmarks/fp8_gemm.py "${FP8_GEMM[@]}" \
    --json "$DEST/fp8_gemm.json"
# 6. Transformer Engine's grouped GEMM fwd+bwd at the routed experts' shapes (8 experts, ragged 128-row groups, one
#    empty), in bf16 and the FP8 recipes of this GPU (tensorwise; mxfp8 from Blackwell), with its numerics
run te_gemm "$T_TE_GEMM" "$DEST/te_gemm.json" "$PY" benchmarks/te_gemm.py "${TE_GEMM[@]}" --json "$DEST/te_gemm.json"
# 7. the alternatives: einsum capacity GEMM (ragged_dot is refused on GPU: XLA densifies it), tokamax's Triton
#    flash attention, XLA's reference attention; cuDNN attention is listed to record its refusal (MLA's q/k head
#    dim 192 is above jax's cuDNN limit of 128)
run kernels_alternatives "$T_KERNELS" "$DEST/kernels_alternatives.json" "$PY" benchmarks/kernels.py \
    --expert_gemm einsum,ragged_dot --attention tokamax_triton,xla,cudnn --dtype "$DTYPE" "${KERNELS[@]}" \
    --json "$DEST/kernels_alternatives.json"
# 8. the slice with capacity dispatch in bf16, blockwise and rowwise FP8 (the JSON lists the compiled GEMM calls)
for fmt in none blockwise rowwise; do
    name=deepseek_layer_capacity$([[ $fmt == none ]] || echo "_fp8_$fmt")
    run "$name" "$T_LAYER_FP8" "$DEST/$name.json" "$PY" benchmarks/deepseek_layer.py --dtype "$DTYPE" "${LAYER[@]}" \
        --dispatch capacity --fp8 "$fmt" --json "$DEST/$name.json"
done

echo
echo "=== rows for benchmarks/RESULTS.md (| date | GPU | command | metric | value |), also in $ROWS:"
if [[ -s "$ROWS" ]]; then cat "$ROWS"; else echo "(no run wrote JSON)"; fi
[[ ${#skipped[@]} -gt 0 ]] && echo "skipped for the ${BUDGET_S}s budget: ${skipped[*]}"
[[ ${#skipped[@]} -gt 0 ]] && failed=1
echo "gpu_check: $([[ $failed -eq 0 ]] && echo "all runs ok" || echo "some run failed, timed out or was skipped")" \
     "in $((SECONDS - START))s; files in $DEST"
exit $failed
