"""Kernel speed on one device, by the kernels the config can select (moejax/kernels/resolve.py):

(a) grouped GEMM: the routed experts' SwiGLU FFN (gate, up, down: three GEMMs) for E local experts with ragged
    group sizes, at DeepSeek-V3 EP32 shapes (8 experts, d_model 7168, d_ff 2048, tokens x top_k rows), by
    `--expert_gemm`; beside it ONE dense GEMM of equal FLOPs, jnp.dot([rows, D], [D, 3F]), and the ratio
    grouped / dense TFLOP/s. Ragged kernels (tokamax, ragged_dot) take the rows sorted by expert and the group
    sizes; einsum takes an [E, C, D] capacity buffer, C the largest group (no drops) or `--capacity_factor` x
    rows / E (rows past C dropped, as capacity dispatch drops them).
(b) attention: causal attention within packed documents (segment ids) at MLA shapes (q/k head dim 192, v head
    dim 128, 128 heads x `--scale`), by `--attention`.

Both forward + backward (jax.vjp with a random cotangent: dgrad and wgrad / dq, dk, dv). FLOP convention, also
written into the JSON:
  GEMMs      2 FLOPs per multiply-add; forward + backward = 3 GEMM passes = 6 FLOPs per MAC. Grouped: MACs of
             the rows that are computed and real (padding rows of the einsum capacity buffer not counted, so
             padding shows as lower TFLOP/s); dense: the same MACs.
  attention  forward = 2 FLOPs per MAC of QK^T and PV over the causal half of the L x L square,
             2 * B * H * (L^2 / 2) * (d_qk + d_v), whatever the document mask skips; backward = 2.5 x forward,
             so fwd+bwd = 3.5 x forward. The fraction of those causal pairs inside documents is reported.
Timing: `--warmup` calls, then `--steps` calls each timed to jax.block_until_ready; the median is reported.
Each kernel's forward output is checked against a float32 reference (rel. L2 error; XLA attention / per-group
dots). A kernel the platform, shapes or installed packages cannot run is reported as refused (the ConfigError),
and the other kernels still run.

    python benchmarks/kernels.py                                            # full size, auto kernels
    python benchmarks/kernels.py --expert_gemm tokamax,einsum --attention tokamax_mosaic,tokamax_triton,cudnn
    python benchmarks/kernels.py --scale 0.0625 --tokens 256 --seq 256 --dtype float32   # CPU smoke run
    python benchmarks/kernels.py --results_rows benchmarks/results/*.json   # rows for benchmarks/RESULTS.md

`--expert_gemm` / `--attention` take a comma-separated list (default `auto`); each is resolved by
moejax/kernels/resolve.py against the device's platform as a training run with MLA and dropless dispatch resolves
it, and the table prints what ran: `auto` is tile_loop and xla on CPU (printed `tile_loop (auto)`), tokamax and
tokamax_mosaic on GPUs. tile_loop runs as dropless runs it: the tile plan of the rows' experts, then the loop.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ConfigError, default_config
from moejax.kernels.attention import attention
from moejax.kernels.grouped_gemm import expert_ffn, ragged_expert_ffn
from moejax.kernels.resolve import devices_compute_capability, devices_platform, kernel_label, resolve_kernel
from moejax.parallel.dropless import tile_rows, window_expert_ffn
from moejax.parallel.hlo_kernels import gemm_custom_calls

FLOP_CONVENTION = {
    "gemm": "2 FLOPs per multiply-add; fwd+bwd = 3 GEMM passes = 6 FLOPs per MAC; grouped counts the real rows "
            "computed (capacity padding not counted); dense GEMM [rows, D] x [D, 3F] has the same MACs",
    "attention": "forward 2 * B * H * (L^2 / 2) * (d_qk + d_v) (causal half, document mask ignored); "
                 "backward 2.5 x forward; fwd+bwd 3.5 x forward",
}


def timed_median(fn, args, warmup: int, steps: int) -> float:
    """Median seconds of one call after `warmup` calls, each call waited for with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fwd_bwd(f):
    """jit of x -> (f(x), grads of <f(x), ct> w.r.t. every argument): forward + full backward."""
    def run(ct, *args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)
    return jax.jit(run)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def resolve_one(field: str, asked: str, platform: str, compute_capability: float | None, dtype: str,
                d_model: int = 7168, d_ff: int = 2048) -> str:
    """The concrete kernel `asked` is for kernels.<field> on `platform` (ConfigError if it cannot run): the
    config is DeepSeek-V3's MLA with dropless dispatch, so auto is the dropless grouped GEMM / flash attention."""
    cfg = default_config()
    m = cfg.model
    m.attention, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.dtype = "mla", 128, 64, 128, dtype
    m.d_model, cfg.moe.d_ff_expert, cfg.moe.dispatch = d_model, d_ff, "dropless"
    cfg.kernels[field] = asked
    return resolve_kernel(cfg, field, platform, compute_capability)


def group_sizes(rows: int, experts: int, alpha: float, seed: int) -> np.ndarray:
    """Ragged expert loads summing to `rows`: multinomial over Dirichlet(alpha) shares (alpha -> inf: equal)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(rows, rng.dirichlet(np.full(experts, alpha))).astype(np.int32)


def bench_grouped_gemm(args, platform: str, cc: float | None, dt) -> dict:
    n_exp, dim, ffn = args.experts, max(8, int(args.d_model * args.scale)), max(8, int(args.d_ff * args.scale))
    rows = args.tokens * args.top_k
    sizes = group_sizes(rows, n_exp, args.group_alpha, args.seed)
    ks = jax.random.split(jax.random.key(args.seed), 6)
    x_RxD = jax.random.normal(ks[0], (rows, dim), dt)
    w_gate = (jax.random.normal(ks[1], (n_exp, dim, ffn), jnp.float32) / math.sqrt(dim)).astype(dt)
    w_up = (jax.random.normal(ks[2], (n_exp, dim, ffn), jnp.float32) / math.sqrt(dim)).astype(dt)
    w_down = (jax.random.normal(ks[3], (n_exp, ffn, dim), jnp.float32) / math.sqrt(ffn)).astype(dt)
    ct_RxD = jax.random.normal(ks[4], (rows, dim), dt)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])

    # float32 reference, one expert's rows at a time (static slices)
    def ref_rows(e, n):
        x = x_RxD[starts[e]:starts[e] + n].astype(jnp.float32)
        g, u = x @ w_gate[e].astype(jnp.float32), x @ w_up[e].astype(jnp.float32)
        return (jax.nn.silu(g) * u) @ w_down[e].astype(jnp.float32)

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda: jnp.concatenate([ref_rows(e, int(sizes[e])) for e in range(n_exp)]))()
    macs_per_row = 3 * dim * ffn
    out = {"shape": {"experts": n_exp, "d_model": dim, "d_ff": ffn, "rows": rows, "tokens": args.tokens,
                     "top_k": args.top_k, "dtype": args.dtype},
           "group_sizes": sizes.tolist(), "kernels": []}

    for asked in args.expert_gemm.split(","):
        row = {"asked": asked}
        try:
            kernel = row["kernel"] = resolve_one("expert_gemm", asked, platform, cc, args.dtype, dim, ffn)
            if kernel == "einsum":
                cap = int(sizes.max()) if args.capacity_factor <= 0 else math.ceil(args.capacity_factor * rows / n_exp)
                kept = np.minimum(sizes, cap)
                # [E, C] gather index into the sorted rows (padding slots point at row 0, masked after)
                idx_ExC = np.zeros((n_exp, cap), np.int32)
                valid_ExC = np.zeros((n_exp, cap), bool)
                for e in range(n_exp):
                    idx_ExC[e, :kept[e]] = starts[e] + np.arange(kept[e])
                    valid_ExC[e, :kept[e]] = True
                to_buffer = lambda a: jnp.where(valid_ExC[..., None], a[idx_ExC], 0).astype(dt)  # noqa: E731
                f = lambda x, wg, wu, wd: expert_ffn(x, wg, wu, wd, kernel="einsum")  # noqa: E731
                inputs, ct = (to_buffer(x_RxD), w_gate, w_up, w_down), to_buffer(ct_RxD)
                real_rows, exec_rows = int(kept.sum()), n_exp * cap
                row.update(capacity=cap, dropped_rows=int(rows - kept.sum()))
            elif kernel == "tile_loop":  # rows in any order with their experts, as dropless hands them over
                expert_R = jnp.asarray(np.repeat(np.arange(n_exp, dtype=np.int32), sizes))
                f = lambda x, wg, wu, wd: window_expert_ffn(  # noqa: E731
                    x, expert_R, wg, wu, wd, gemm="tile_loop", ffn_axis=None)
                inputs, ct = (x_RxD, w_gate, w_up, w_down), ct_RxD
                tile = row["tile_rows"] = tile_rows(rows, n_exp)
                real_rows, exec_rows = rows, int((-(-sizes // tile)).sum()) * tile
            else:
                f = lambda x, wg, wu, wd, k=kernel: ragged_expert_ffn(  # noqa: E731
                    x, wg, wu, wd, jnp.asarray(sizes), kernel=k)
                inputs, ct = (x_RxD, w_gate, w_up, w_down), ct_RxD
                real_rows, exec_rows = rows, rows
            step = fwd_bwd(f)
            y = jax.block_until_ready(step(ct, *inputs))[0]
            if kernel == "einsum":  # compare the kept rows
                y_rows = np.asarray(y, np.float32)[valid_ExC]
                ref_rows_kept = np.concatenate([np.asarray(ref[starts[e]:starts[e] + kept[e]]) for e in range(n_exp)])
                row["fwd_rel_err"] = rel_err(y_rows, ref_rows_kept)
            else:
                row["fwd_rel_err"] = rel_err(y, ref)
            sec = timed_median(step, (ct, *inputs), args.warmup, args.steps)
            flops = 6 * macs_per_row * real_rows
            row.update(status="ok", step_ms=sec * 1e3, real_rows=real_rows, executed_rows=exec_rows,
                       tflop=flops / 1e12, tflops=flops / sec / 1e12)
        except ConfigError as err:
            row.update(status="refused", reason=str(err))
        except Exception as err:  # noqa: BLE001 - a kernel that fails to compile or run is reported, not fatal
            row.update(status="failed", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        out["kernels"].append(row)

    # one dense GEMM of equal MACs for each distinct real-row count measured
    dense = {}
    for real_rows in sorted({r["real_rows"] for r in out["kernels"] if r.get("status") == "ok"} or {rows}):
        w_DxF3 = (jax.random.normal(ks[5], (dim, 3 * ffn), jnp.float32) / math.sqrt(dim)).astype(dt)
        x = x_RxD[:real_rows]
        ct = jax.random.normal(ks[4], (real_rows, 3 * ffn), dt)
        step = fwd_bwd(lambda a, b: jnp.dot(a, b))
        sec = timed_median(step, (ct, x, w_DxF3), args.warmup, args.steps)
        flops = 6 * macs_per_row * real_rows
        dense[real_rows] = {"rows": real_rows, "shape": f"[{real_rows}, {dim}] x [{dim}, {3 * ffn}]",
                            "step_ms": sec * 1e3, "tflop": flops / 1e12, "tflops": flops / sec / 1e12}
    out["dense"] = list(dense.values())
    for row in out["kernels"]:
        if row.get("status") == "ok":
            d = dense[row["real_rows"]]
            row["dense_tflops"] = d["tflops"]
            row["ratio_vs_dense"] = row["tflops"] / d["tflops"]
    return out


def document_segments(batch: int, seq: int, mean_len: int, seed: int) -> np.ndarray:
    """[B, L] segment ids of packed documents, lengths drawn from an exponential of mean `mean_len` (>= 1)."""
    rng = np.random.default_rng(seed + 1)
    seg = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        pos, doc = 0, 0
        while pos < seq:
            n = max(1, int(rng.exponential(mean_len)))
            seg[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return seg


def bench_attention(args, platform: str, cc: float | None, dt) -> dict:
    batch, seq = max(1, args.tokens // args.seq), args.seq
    heads, d_qk, d_v = max(1, int(args.heads * args.scale)), 192, 128
    doc_len = args.doc_len or max(1, seq // 4)
    seg_np = document_segments(batch, seq, doc_len, args.seed)
    in_doc = sum(int(n) * (int(n) + 1) / 2 for b in range(batch) for n in np.bincount(seg_np[b]) if n)
    ks = jax.random.split(jax.random.key(args.seed + 7), 4)
    q = jax.random.normal(ks[0], (batch, seq, heads, d_qk), dt)
    k = jax.random.normal(ks[1], (batch, seq, heads, d_qk), dt)
    v = jax.random.normal(ks[2], (batch, seq, heads, d_v), dt)
    ct = jax.random.normal(ks[3], (batch, seq, heads, d_v), dt)
    seg = jnp.asarray(seg_np)
    scale = 1.0 / math.sqrt(d_qk)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda q, k, v, s: attention(f32(q), f32(k), f32(v), s, scale, kernel="xla"))(q, k, v, seg)
    fwd_flops = 2 * batch * heads * (seq * seq / 2) * (d_qk + d_v)
    out = {"shape": {"batch": batch, "seq": seq, "heads": heads, "d_qk": d_qk, "d_v": d_v, "dtype": args.dtype,
                     "documents": int(sum(len(np.unique(s)) for s in seg_np)), "mean_doc_len": doc_len},
           "causal_pairs_fraction_in_documents": in_doc / (batch * seq * (seq + 1) / 2),
           "fwd_tflop": fwd_flops / 1e12, "kernels": []}
    for asked in args.attention.split(","):
        row = {"asked": asked}
        try:
            kernel = row["kernel"] = resolve_one("attention", asked, platform, cc, args.dtype)
            step = fwd_bwd(lambda q, k, v, kernel=kernel: attention(q, k, v, seg, scale, kernel=kernel))
            row["fwd_rel_err"] = rel_err(jax.block_until_ready(step(ct, q, k, v))[0], ref)
            sec = timed_median(step, (ct, q, k, v), args.warmup, args.steps)
            flops = 3.5 * fwd_flops
            row.update(status="ok", step_ms=sec * 1e3, tflop=flops / 1e12, tflops=flops / sec / 1e12)
        except ConfigError as err:
            row.update(status="refused", reason=str(err))
        except Exception as err:  # noqa: BLE001
            row.update(status="failed", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        out["kernels"].append(row)
    return out


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _label(row: dict) -> str:
    """A kernel row's kernel as printed: 'tile_loop (auto)' when auto chose it, the asked name if refused."""
    return kernel_label(row["kernel"], row["asked"]) if "kernel" in row else row["asked"]


def print_table(res: dict):
    print(f"\n{res['device']} ({res['platform']}), {res['dtype']}, jax {res['jax']}, tokamax {res['tokamax']}")
    if "grouped_gemm" in res:
        g = res["grouped_gemm"]
        s = g["shape"]
        print(f"grouped GEMM fwd+bwd: {s['experts']} experts x [{s['d_model']} -> {s['d_ff']} -> {s['d_model']}] SwiGLU,"
              f" {s['rows']} rows, groups {g['group_sizes']}")
        print(f"  {'kernel':<20}{'rows':>14}{'step ms':>10}{'TFLOP/s':>10}{'dense TFLOP/s':>15}{'ratio':>8}"
              f"{'rel err':>10}")
        for r in g["kernels"]:
            if r["status"] != "ok":
                print(f"  {_label(r):<20}{r['status']}: {r['reason']}")
                continue
            rows = f"{r['real_rows']}/{r['executed_rows']}"
            print(f"  {_label(r):<20}{rows:>14}{r['step_ms']:>10.3f}{r['tflops']:>10.2f}{r['dense_tflops']:>15.2f}"
                  f"{r['ratio_vs_dense']:>8.2f}{r['fwd_rel_err']:>10.1e}")
        for d in g["dense"]:
            print(f"  {'dense jnp.dot':<20}{d['rows']:>14}{d['step_ms']:>10.3f}{d['tflops']:>10.2f}   {d['shape']}")
    if "attention" in res:
        a = res["attention"]
        s = a["shape"]
        print(f"attention fwd+bwd: B {s['batch']} x L {s['seq']} x H {s['heads']}, d_qk {s['d_qk']}, d_v {s['d_v']}, "
              f"causal, {s['documents']} documents ({a['causal_pairs_fraction_in_documents']:.1%} of the causal pairs "
              f"in documents)")
        print(f"  {'kernel':<20}{'step ms':>10}{'TFLOP/s':>10}{'rel err':>10}")
        for r in a["kernels"]:
            if r["status"] != "ok":
                print(f"  {_label(r):<20}{r['status']}: {r['reason']}")
                continue
            print(f"  {_label(r):<20}{r['step_ms']:>10.3f}{r['tflops']:>10.2f}{r['fwd_rel_err']:>10.1e}")


def _num(x: float) -> str:
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def results_rows(paths) -> list[str]:
    """Rows of benchmarks/RESULTS.md (| date | GPU | command | metric | value |) from JSON this script,
    deepseek_layer.py, fp8_gemm.py, te_gemm.py or train_step.py wrote."""
    rows = []
    for path in paths:
        r = json.loads(Path(path).read_text())
        cmd = shlex.split(r.get("command", "?"))
        if "--json" in cmd:  # where the JSON went is no part of what was measured
            i = cmd.index("--json")
            del cmd[i:i + 2]
        head = f"| {r.get('date', '?')} | {r.get('device', '?')} | `{shlex.join(cmd)}` |"
        if "mfu_vs_measured_peak" in r:  # deepseek_layer.py
            k = r.get("kernels", {})
            fp8 = r.get("fp8", "none")
            what = (f"DeepSeek-V3 layer slice fwd+bwd, {r['tokens']} tokens, {r['dtype']}, "
                    f"{r.get('dispatch', 'dropless')}, {k.get('attention', '?')}/{k.get('expert_gemm', '?')}"
                    + (f", fp8 {fp8}" if fp8 != "none" else ""))
            rows.append(f"{head} {what}: model TFLOP/s | {_num(r['tflops'])} |")
            rows.append(f"{head} {what}: MFU vs measured matmul peak ({_num(r['matmul_peak_tflops'])} TFLOP/s) | "
                        f"{r['mfu_vs_measured_peak']:.1%} |")
            if compiled := r.get("compiled"):  # GPU GEMMs are cuBLAS(Lt) custom calls; CPU ones stay dots
                gemms = gemm_custom_calls(compiled)
                gemms |= {f"dot {t}": n for t, n in compiled.get("dots", {}).items()}
                n_f8 = sum(n for t, n in gemms.items() if "f8" in t)
                listed = ", ".join(f"{t} x{n}" for t, n in gemms.items())
                rows.append(f"{head} {what}: compiled GEMMs in FP8 ({_cell(listed)}) | {n_f8} of "
                            f"{sum(gemms.values())} |")
            continue
        if "fp8_gemm" in r:  # fp8_gemm.py
            sh = r["fp8_gemm"]["shape"]
            what = f"GEMM fwd+bwd x [{sh['m']}, {sh['k']}] @ w [{sh['k']}, {sh['n']}] {sh['dtype']} in/out"
            for f in r["fp8_gemm"]["formats"]:
                if "error" in f:
                    rows.append(f"{head} {what}, {f['format']} | failed: {_cell(f['error'])} |")
                    continue
                calls = ", ".join(f"{k} x{v}" for k, v in f["gemm_custom_calls"].items()) or "none"
                rows.append(f"{head} {what}, {f['format']}: TFLOP/s (GEMM calls: {_cell(calls)}) | "
                            f"{_num(f['tflops'])} |")
                if f.get("speed_vs_none"):
                    rows.append(f"{head} {what}, {f['format']}: speed vs bf16 | {f['speed_vs_none']:.2f}x |")
            continue
        if "te_gemm" in r:  # te_gemm.py
            sh = r["te_gemm"]["shape"]
            what = (f"TE grouped GEMM fwd+bwd x [{sh['rows']}, {sh['k']}] in {sh['g']} groups @ w [{sh['g']}, "
                    f"{sh['k']}, {sh['n']}] {sh['dtype']} in/out")
            for f in r["te_gemm"]["formats"]:
                name = f"{what}, {f['format']}, {f['implementation']}"
                if "error" in f:
                    rows.append(f"{head} {name} | failed: {_cell(f['error'])} |")
                    continue
                c = f["te_calls"]
                calls = "; ".join([", ".join(f"{k} x{n}" for k, n in c["by_kind"].items()),
                                   ", ".join(f"{ops} x{n}" for ops, n in c["by_operands"].items()),
                                   f"V2 {c['v2']} of {c['total']}"]) if c["total"] else "none"
                rows.append(f"{head} {name}: TFLOP/s (TE calls: {_cell(calls)}) | "
                            f"{_num(f['tflops'])} |")
                if f.get("speed_vs_none"):
                    rows.append(f"{head} {name}: speed vs bf16 | {f['speed_vs_none']:.2f}x |")
                rows += [f"{head} {name}: relative error of {t} vs f32 | {f[f'rel_err_{t}']:.1e} |"
                         for t in ("y", "dx", "dw")]
            continue
        if "rows" in r and "flops_per_token" in r:  # train_step.py
            head = f"| {r.get('date', '?')} | {r.get('device_kind', '?')} | `{shlex.join(cmd)}` |"
            for t in r["rows"]:
                what = (f"training step, {r['config']}, {t['layout']}, {t['dispatch']}"
                        + (f", fp8 {t['fp8']}" if t.get("fp8", "none") != "none" else "")
                        + (", tuned kernel configs" if t.get("kernel_configs") == "tuned" else ""))
                rows.append(f"{head} {what}: step ms | {t['step_time_s'] * 1e3:.1f} |")
                rows.append(f"{head} {what}: model TFLOP/s per device | {_num(t['tflops_per_device'])} |")
                rows.append(f"{head} {what}: MFU ({r['peak_source']}) | {t['mfu']:.1%} |")
                if "mfu_vs_matmul_peak" in t:
                    mm = r["matmul_peak_flops_per_device"] / 1e12
                    rows.append(f"{head} {what}: MFU vs measured matmul peak ({_num(mm)} TFLOP/s) | "
                                f"{t['mfu_vs_matmul_peak']:.1%} |")
                if "device_peak_bytes" in t:
                    rows.append(f"{head} {what}: device peak memory GB (the process's so far) | "
                                f"{t['device_peak_bytes'] / 1e9:.1f} |")
                if "mfu" in t.get("plan", {}):
                    p = t["plan"]
                    rows.append(f"{head} {what}: planner's prediction (memory GB, MFU) | "
                                f"{p['memory_bytes'] / 1e9:.1f}, {p['mfu']:.1%} |")
                rows.append(f"{head} {what}: dropped assignments | {t.get('dropped_fraction', 0):.1%} |")
            continue
        if "grouped_gemm" in r:
            g = r["grouped_gemm"]
            s = g["shape"]
            what = f"grouped GEMM fwd+bwd E{s['experts']} D{s['d_model']} F{s['d_ff']} R{s['rows']} {s['dtype']}"
            rows += _kernel_rows(head, what, g["kernels"], lambda k: [
                ("TFLOP/s", _num(k["tflops"])),
                (f"ratio vs one dense GEMM of equal FLOPs ({_num(k['dense_tflops'])} TFLOP/s)",
                 f"{k['ratio_vs_dense']:.2f}")])
        if "attention" in r:
            a = r["attention"]
            s = a["shape"]
            what = (f"attention fwd+bwd B{s['batch']} L{s['seq']} H{s['heads']} d{s['d_qk']}/{s['d_v']} causal "
                    f"packed {s['dtype']}")
            rows += _kernel_rows(head, what, a["kernels"],
                                 lambda k: [("TFLOP/s (causal half, bwd 2.5x fwd)", _num(k["tflops"]))])
    return rows


def _kernel_rows(head: str, what: str, kernels: list[dict], metrics) -> list[str]:
    """One row per metric of each kernel that ran (metrics(k) -> [(name, value)]), one row saying why for each
    that did not."""
    rows = []
    for k in kernels:
        name = k.get("kernel", k["asked"])
        if k["status"] != "ok":
            rows.append(f"{head} {what}, {name} | {_cell(k['status'] + ': ' + k['reason'][:160])} |")
            continue
        rows += [f"{head} {what}, {name}: {metric} | {value} |" for metric, value in metrics(k)]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--expert_gemm", default="auto", help="comma-separated kernels.expert_gemm values")
    p.add_argument("--attention", default="auto", help="comma-separated kernels.attention values")
    p.add_argument("--only", choices=("both", "gemm", "attention"), default="both")
    p.add_argument("--scale", type=float, default=1.0, help="width multiplier (d_model, d_ff, heads)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens on the device (GEMM rows = tokens x top_k)")
    p.add_argument("--top_k", type=int, default=2, help="local expert picks per token (EP32 average: 8 / 32 x 8)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d_model", type=int, default=7168)
    p.add_argument("--d_ff", type=int, default=2048)
    p.add_argument("--group_alpha", type=float, default=8.0, help="Dirichlet concentration of the expert loads")
    p.add_argument("--capacity_factor", type=float, default=0.0, help="einsum: 0 = capacity of the largest group")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--doc_len", type=int, default=0, help="mean packed document length (exponential); 0: seq / 4")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/kernels.json")
    p.add_argument("--results_rows", nargs="+", metavar="JSON",
                   help="print benchmarks/RESULTS.md rows from these JSON files (this script's or "
                        "deepseek_layer.py's) and exit")
    args = p.parse_args()
    if args.results_rows:
        print("\n".join(results_rows(args.results_rows)))
        return

    dev = jax.devices()[0]
    platform, cc, dt = devices_platform([dev]), devices_compute_capability([dev]), jnp.dtype(args.dtype)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "command": shlex.join(["python", *sys.argv]), "device": dev.device_kind, "platform": platform,
           "jax": jax.__version__, "tokamax": _version("tokamax"), "dtype": args.dtype, "scale": args.scale,
           "warmup": args.warmup, "steps": args.steps, "timing": "median of steps, each to block_until_ready",
           "flop_convention": FLOP_CONVENTION}
    if args.only in ("both", "gemm"):
        res["grouped_gemm"] = bench_grouped_gemm(args, platform, cc, dt)
    if args.only in ("both", "attention"):
        res["attention"] = bench_attention(args, platform, cc, dt)
    print_table(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
