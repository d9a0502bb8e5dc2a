"""Mosaic GPU paged decode against cuDNN paged decode, in one run (H200, bf16, Hq=32, Hkv=8,
D=128).

    PYTHONPATH=$PWD python3 -m benchmarks.mosaic_decode --out benchmarks/results/mosaic_decode.json

Every case times several variants of the Mosaic kernel side by side (the defaults, other
configs and split counts, and the first H200 run's default: block_kv=64, 4 stages, about two
programs per SM), cuDNN's paged attention (the anchor of the issue's goals) and, when it exists,
the Triton decode kernel, so that defaults can be picked from one run. Bandwidth is unique KV
bytes read / CUPTI median time of all kernels of a call (XLA merge included); `vs_cudnn` is the
ratio of cuDNN's time to ours in this run. A failing row records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib

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
# Goals of the issue in TB/s of KV (cuDNN's own number is the goal where it is None).
GOALS = {"b1-ctx32768-ps16": 3.7, "b1-ctx32768-ps64": 3.7, "b64-ragged4096-ps16": 3.9}

OLD_DEFAULT = mosaic.MosaicDecodeConfig(block_kv=64, num_stages=4)
_CONFIG = mosaic.MosaicDecodeConfig
# (label, config or None for the default, splits: "rule", a multiple of the rule's count, or
# "old" for the first run's rule of about two programs per SM). Runs 1 and 3 timed 2x and 4x
# splits and the run-1 default (results/mosaic_decode_h200_run{1,3}.json); this set times
# configs small enough for two programs per SM, and the longest-first order.
VARIANTS = [
    ("mosaic default", None, "rule"),
    ("mosaic stages=3", _CONFIG(num_stages=3), "rule"),
    ("mosaic default, 2x splits", None, 2),
    ("mosaic default, longest first", _CONFIG(longest_first=True), "rule"),
    ("mosaic block_kv=64 stages=2", _CONFIG(block_kv=64, num_stages=2), "rule"),
    ("mosaic block_kv=64 stages=3", _CONFIG(block_kv=64, num_stages=3), "rule"),
    (
        "mosaic block_kv=64 stages=2, longest first",
        _CONFIG(block_kv=64, num_stages=2, longest_first=True),
        "rule",
    ),
    (
        "mosaic block_kv=64 stages=3, longest first",
        _CONFIG(block_kv=64, num_stages=3, longest_first=True),
        "rule",
    ),
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
    config = config or mosaic.default_config(HEAD_DIM)
    max_steps = -(-max_len // config.block_kv)
    if splits == "old":
        programs = batch * NUM_KV_HEADS
        return max(1, min(2 * H200_NUM_SMS // programs, max_steps // 4))
    num_sms = mosaic.programs_per_sm(config, HEAD_DIM) * H200_NUM_SMS
    rule = mosaic.choose_num_splits(batch, NUM_KV_HEADS, max_steps, num_sms=num_sms)
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


def triton_fn():
    module = importlib.import_module("pallas_kernels.triton.paged_decode")

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
            config=None,
            interpret=False,
        )

    return fn


def run(iterations: int, cases=None, breakdown: bool = False) -> list[dict]:
    rows = []
    for name, batch, context, page_size in CASES:
        if cases and name not in cases:
            continue
        inputs = make_inputs(batch, context, page_size)
        nbytes = kv_bytes(inputs[3])
        max_len = inputs[4].shape[1] * page_size
        kernels = []
        for label, config, how in VARIANTS:
            splits = mosaic_splits(config, how, batch, max_len)
            kernels.append((label, splits, lambda c=config, n=splits: mosaic_fn(c, n)))
        kernels += [("cudnn paged", None, cudnn_fn), ("triton", None, triton_fn)]
        case_rows = []
        for label, splits, make in kernels:
            row = dict(case=name, kernel=label, kv_bytes=nbytes, splits=splits)
            try:
                ms = kernel_time_ms(make(), *inputs, iterations=iterations)
                row.update(ms=ms, tb_s=nbytes / (ms * 1e-3) / 1e12)
                if breakdown:
                    row["kernels"] = kernel_breakdown_ms(make(), *inputs, iterations=iterations)
            except Exception as e:  # noqa: BLE001 - record and go on to the next kernel
                row["error"] = error_text(e)
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
        del inputs
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/mosaic_decode.json")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument(
        "--breakdown", action="store_true", help="also record every kernel's median time"
    )
    args = parser.parse_args()
    rows = run(args.iterations, args.cases, args.breakdown)
    for row in rows:
        for kernel, ms in row.get("kernels", []):
            print(f"  {row['case']:20} {row['kernel']:40} {ms * 1e3:8.2f} us  {kernel[:60]}")
    write_results(args.out, "mosaic_decode", rows)
    print_table(rows, ["case", "kernel", "splits", "ms", "tb_s", "vs_cudnn", "goal_tb_s", "error"])


if __name__ == "__main__":
    main()
