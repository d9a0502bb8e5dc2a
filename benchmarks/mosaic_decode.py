"""Mosaic GPU paged decode against cuDNN paged decode, in one run (H200, bf16, Hq=32, Hkv=8,
D=128).

    PYTHONPATH=$PWD python3 -m benchmarks.mosaic_decode --out benchmarks/results/mosaic_decode.json

Every case times several variants of the Mosaic kernel side by side (the default, other
configs and split counts), cuDNN's paged attention (the anchor of the issue's goals) and the
Triton decode kernel, so that defaults can be picked from one run. Bandwidth is unique KV bytes
read / CUPTI median time of all kernels of a call (sort and merge included); `vs_cudnn` is the
ratio of cuDNN's time to ours in this run. A failing row records its error and the run goes on.
`--breakdown` also records every kernel's time; `--profile-dir DIR` instead runs the default
kernel under Mosaic GPU's in-kernel profiler and summarizes each program's phases.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    error_text,
    kernel_breakdown_ms,
    kernel_time_ms,
    print_table,
    write_results,
)
from jaxpaged.dispatch import many_short_sequences
from pallas_kernels.common import H200_NUM_SMS
from pallas_kernels.mosaic import paged_decode as mosaic

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = jnp.bfloat16

# (name, batch, context or "ragged", page_size); ragged lengths are U[1, 4096].
CASES = [
    ("b64-ctx4096-ps16", 64, 4096, 16),
    ("b64-ctx4096-ps64", 64, 4096, 64),
    ("b8-ctx32768-ps64", 8, 32768, 64),
    ("b8-ctx32768-ps16", 8, 32768, 16),
    ("b1-ctx32768-ps16", 1, 32768, 16),
    ("b1-ctx32768-ps64", 1, 32768, 64),
    ("b64-ragged4096-ps16", 64, "ragged", 16),
]
# Cases either side of `implementation=None`'s thresholds (`many_short_sequences`: contexts of
# at most 512 tokens with more than two (sequence, KV head) items per SM stay with Triton) and
# of the in-kernel ordering's (`mosaic._MAX_SLOTS_RANKED`), run only when named in `--cases`.
DISPATCH_CASES = [
    ("b16-ctx1024-ps16", 16, 1024, 16),
    ("b32-ctx512-ps16", 32, 512, 16),
    ("b64-ctx512-ps16", 64, 512, 16),
    ("b256-ctx512-ps16", 256, 512, 16),
    ("b128-ragged4096-ps16", 128, "ragged", 16),
    ("b256-ragged4096-ps16", 256, "ragged", 16),
    ("b64-ctx1024-ps16", 64, 1024, 16),
    ("b256-ctx1024-ps16", 256, 1024, 16),
    ("b256-ctx2048-ps16", 256, 2048, 16),
    ("b256-ctx4096-ps16", 256, 4096, 16),
]
# Goals of the issue in TB/s of KV (cuDNN's own number is the goal where it is None).
GOALS = {"b1-ctx32768-ps16": 3.7, "b1-ctx32768-ps64": 3.7, "b64-ragged4096-ps16": 3.9}

_CONFIG = mosaic.MosaicDecodeConfig
# (label, config or None for the default, splits: "rule" or a multiple of the rule's count).
# Earlier runs timed 2x and 4x splits, small configs, the first default, a pool of steps
# shared by the splits (branch `step-pool`; results/mosaic_decode_h200_run*.json) and TMA
# prefetches of later steps into L2 (run 35: 15-40% slower, removed); this set
# times the persistent default against its unsorted form and the one-item-per-program grid.
VARIANTS = [
    ("mosaic default", None, "rule"),
    ("mosaic persistent, unsorted", _CONFIG(longest_first=False), "rule"),
    ("mosaic one item per program", _CONFIG(persistent=False, longest_first=False), "rule"),
]


def make_inputs(batch: int, context, page_size: int, seed: int = 0):
    """Random q, pages scattered over the pool, the page table and lengths."""
    rng = np.random.default_rng(seed)
    max_len = 4096 if context == "ragged" else context
    if context == "ragged":
        lens = rng.integers(1, 4097, size=batch)
    else:
        lens = np.full(batch, context)
    pages_per_seq = -(-max_len // page_size)
    num_pages = batch * pages_per_seq
    table = rng.permutation(num_pages).astype(np.int32).reshape(batch, pages_per_seq)
    k_q, k_k, k_v = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, page_size, NUM_KV_HEADS, HEAD_DIM)
    q = jax.random.normal(k_q, (batch, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    k_pages = jax.random.normal(k_k, shape, DTYPE)
    v_pages = jax.random.normal(k_v, shape, DTYPE)
    return q, k_pages, v_pages, jnp.asarray(lens, jnp.int32), jnp.asarray(table)


def kv_bytes(kv_lens) -> int:
    """Unique K and V bytes the visible keys occupy."""
    itemsize = jnp.dtype(DTYPE).itemsize
    return int(np.asarray(kv_lens).sum()) * NUM_KV_HEADS * HEAD_DIM * itemsize * 2


def mosaic_splits(config, splits, batch: int, max_len: int) -> int:
    """The split count a variant runs with."""
    config = config or mosaic.MosaicDecodeConfig.default(HEAD_DIM)
    max_steps = -(-max_len // config.block_kv)
    rule = mosaic.choose_num_splits(batch, NUM_KV_HEADS, max_steps, num_sms=H200_NUM_SMS)
    return rule if splits == "rule" else min(rule * splits, max_steps)


def mosaic_fn(config, num_splits):
    def fn(q, k_pages, v_pages, kv_lens, table):
        return mosaic.paged_decode_attention(
            q,
            k_pages,
            v_pages,
            kv_lens,
            table,
            num_splits=num_splits,
            sm_scale=HEAD_DIM**-0.5,
            config=config,
        )

    return fn


def cudnn_fn():
    from jax._src.cudnn import fused_attention_stablehlo as fa  # private: guarded by caller

    def fn(q, k_pages, v_pages, kv_lens, table):
        batch = q.shape[0]
        pt = table[:, None, :, None]
        return fa.paged_attention(
            q[:, None],
            k_pages,
            v_pages,
            jnp.ones((batch,), jnp.int32),
            kv_lens,
            pt,
            pt,
            scale=HEAD_DIM**-0.5,
            mask_type=fa.MaskType.PADDING,
        )

    return fn


def triton_fn(**config):
    module = importlib.import_module("pallas_kernels.triton.paged_decode")
    head_config = module.DecodeConfig.default(HEAD_DIM, DTYPE)

    def fn(q, k_pages, v_pages, kv_lens, table):
        return module.paged_decode_attention(
            q,
            k_pages,
            v_pages,
            kv_lens,
            table,
            num_splits=None,
            sm_scale=HEAD_DIM**-0.5,
            sliding_window=None,
            logits_soft_cap=None,
            config=dataclasses.replace(head_config, **config),
            interpret=False,
        )

    return fn


def run(iterations: int, cases=None, breakdown: bool = False, out=None) -> list[dict]:
    """Times every case; with `out`, rewrites the results file after each case (a run cut
    short keeps what it measured)."""
    rows = []
    known = {case[0]: case for case in CASES + DISPATCH_CASES}
    if unknown := set(cases or ()) - set(known):
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {sorted(known)}")
    for name, batch, context, page_size in [known[c] for c in cases] if cases else CASES:
        inputs = make_inputs(batch, context, page_size)
        nbytes = kv_bytes(inputs[3])
        max_len = inputs[4].shape[1] * page_size
        # What `implementation=None` runs for this batch on the H200.
        short = many_short_sequences(batch, NUM_KV_HEADS, max_len, H200_NUM_SMS)
        picks = "triton" if short else "mosaic"
        kernels = []
        for label, config, how in VARIANTS:
            splits = mosaic_splits(config, how, batch, max_len)
            kernels.append((label, splits, lambda c=config, n=splits: mosaic_fn(c, n)))
        kernels += [("cudnn paged", None, cudnn_fn), ("triton", None, triton_fn)]
        case_rows = []
        reference = None
        for label, splits, make in kernels:
            row = dict(case=name, kernel=label, kv_bytes=nbytes, splits=splits, rule_picks=picks)
            try:
                fn = jax.jit(make())  # one compilation for every timing of the row
                if label.startswith("mosaic"):  # variants of the default: same numbers
                    got = np.asarray(jax.block_until_ready(fn(*inputs))[0], np.float32)
                    if reference is None:
                        reference = got
                    else:
                        row["max_diff_vs_default"] = float(np.max(np.abs(got - reference)))
                ms = kernel_time_ms(fn, *inputs, iterations=iterations)
                row.update(ms=ms, tb_s=nbytes / (ms * 1e-3) / 1e12)
                if breakdown:
                    row["kernels"] = kernel_breakdown_ms(fn, *inputs, iterations=iterations)
                    # What XLA runs besides kernels (a memset is not a kernel to CUPTI).
                    row["thunks"] = compiled_ops(fn, *inputs)
            except Exception as e:  # noqa: BLE001 - record and go on to the next kernel
                row["error"] = error_text(e)
            print(
                f"  {name:20} {label:28} {row.get('ms', 0) * 1e3:8.2f} us "
                f"{row.get('tb_s', 0):6.3f} TB/s {row.get('max_diff_vs_default', '')} "
                f"{row.get('error', '')}",
                flush=True,
            )
            case_rows.append(row)
        cudnn_ms = next((r.get("ms") for r in case_rows if r["kernel"] == "cudnn paged"), None)
        goal = GOALS.get(name)
        for row in case_rows:
            if cudnn_ms and row.get("ms"):
                row["vs_cudnn"] = cudnn_ms / row["ms"]
            if row.get("tb_s"):
                row["goal_tb_s"] = (
                    goal if goal else (cudnn_ms and nbytes / (cudnn_ms * 1e-3) / 1e12)
                )
        rows += case_rows
        if out:
            write_results(out, "mosaic_decode", rows)
        del inputs
    return rows


def compiled_ops(fn, *args) -> list[str]:
    """The instructions of the compiled entry computation, one line each, shortened."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    return [line.strip()[:160] for line in entry.splitlines()[1:] if "=" in line]


def profile(cases, out_dir: str) -> list[dict]:
    """One call of the default Mosaic kernel per case with Mosaic GPU's in-kernel profiler on,
    summarized per program: when its first K/V step landed, how long its steps and its output
    write took, and the gap to the next program on the same SM."""
    rows = []
    for name, batch, context, page_size in CASES:
        if cases and name not in cases:
            continue
        inputs = make_inputs(batch, context, page_size)
        trace_dir = os.path.join(out_dir, name)
        os.makedirs(trace_dir, exist_ok=True)
        splits = mosaic_splits(None, "rule", batch, inputs[4].shape[1] * page_size)

        def fn(*args, trace_dir=trace_dir, splits=splits):
            return mosaic.paged_decode_attention(
                *args,
                num_splits=splits,
                sm_scale=HEAD_DIM**-0.5,
                profile_dir=trace_dir,
            )

        try:
            f = jax.jit(fn)
            for _ in range(3):  # every call writes the same file name: keep the last call's
                for old in glob.glob(os.path.join(trace_dir, "*.json")):
                    os.remove(old)
                jax.block_until_ready(f(*inputs))
                jax.effects_barrier()
            [trace] = glob.glob(os.path.join(trace_dir, "*.json"))
            rows.append(dict(case=name, splits=splits, **summarize_trace(trace)))
        except Exception as e:  # noqa: BLE001 - record and go on
            rows.append(dict(case=name, error=error_text(e)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def summarize_trace(path: str, clock_ghz: float = 1.98) -> dict:
    """Per-program phases (µs) from one Mosaic GPU profiler trace of the decode kernel.

    The profiler stamps a program's first event with the global timer (ns) and later events
    with the SM clock (cycles since that event), so durations inside a program are divided by
    the SM clock (`clock_ghz`, the H200's boost clock by default) to give µs.
    """
    events = json.load(open(path))["traceEvents"]
    by_tid: dict = {}
    for e in events:
        by_tid.setdefault(e["tid"], []).append(e)
    programs = []
    for evs in by_tid.values():
        if "compute" not in {e["name"] for e in evs}:
            continue
        origin = evs[0]["ts"]  # global timer, µs
        begin: dict = {}
        spans: dict = {}
        for e in evs:
            t = (e["ts"] - origin) / clock_ghz  # µs since the program's first event
            if e["ph"] == "B":
                begin.setdefault(e["name"], []).append(t)
            else:
                spans.setdefault(e["name"], []).append((begin[e["name"]].pop(), t))
        start, end = spans["compute"][0]
        waits = spans.get("wait_k", [])
        epi = spans.get("epilogue", [(end, end)])[0]
        programs.append(
            dict(
                sm=evs[0]["pid"],
                start=origin + start,
                end=origin + end,
                first=waits[0][1] - start if waits else 0.0,
                epilogue=epi[1] - epi[0],
                wait_k=sum(b - a for a, b in waits),
                wait_v=sum(b - a for a, b in spans.get("wait_v", [])),
            )
        )
    programs.sort(key=lambda p: (p["sm"], p["start"]))
    pairs = zip(programs, programs[1:], strict=False)
    gaps = [b["start"] - a["end"] for a, b in pairs if a["sm"] == b["sm"]]
    t0 = min(p["start"] for p in programs)
    t1 = max(p["end"] for p in programs)
    last_end_per_sm: dict = {}
    for p in programs:
        last_end_per_sm[p["sm"]] = max(last_end_per_sm.get(p["sm"], 0), p["end"])

    def stats(xs):
        xs = sorted(xs)
        if not xs:
            return None
        return dict(
            mean=round(float(np.mean(xs)), 3),
            p50=round(xs[len(xs) // 2], 3),
            max=round(xs[-1], 3),
            min=round(xs[0], 3),
        )

    return dict(
        programs=len(programs),
        sms=len(last_end_per_sm),
        span_us=round(t1 - t0, 3),
        first_start_spread_us=round(
            max(p["start"] for p in programs if p["start"] - t0 < 5) - t0, 3
        ),
        first_data_us=stats([p["first"] for p in programs]),
        epilogue_us=stats([p["epilogue"] for p in programs]),
        wait_k_total_us=stats([p["wait_k"] for p in programs]),
        wait_v_total_us=stats([p["wait_v"] for p in programs]),
        program_us=stats([p["end"] - p["start"] for p in programs]),
        gap_same_sm_us=stats(gaps),
        sm_idle_at_end_us=stats([t1 - e for e in last_end_per_sm.values()]),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/mosaic_decode.json")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument(
        "--breakdown", action="store_true", help="also record every kernel's median time"
    )
    parser.add_argument("--profile-dir", help="only profile the default kernel, traces here")
    args = parser.parse_args()
    if args.profile_dir:
        write_results(args.out, "mosaic_decode_profile", profile(args.cases, args.profile_dir))
        return
    rows = run(args.iterations, args.cases, args.breakdown, out=args.out)
    for row in rows:
        for kernel, ms in row.get("kernels", []):
            print(f"  {row['case']:20} {row['kernel']:40} {ms * 1e3:8.2f} us  {kernel[:60]}")
    write_results(args.out, "mosaic_decode", rows)
    print_table(rows, ["case", "kernel", "splits", "ms", "tb_s", "vs_cudnn", "goal_tb_s", "error"])


if __name__ == "__main__":
    main()
