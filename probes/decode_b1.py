"""Probe: where the Mosaic decode kernel's ~7 us a layer go at B=1 (issue 20).

At e2e's B=1 shape (`1b`: Hq 16, Hkv 8, D 128, pages of 16, 1,097 cached tokens in a table of
76 pages) the kernel takes 6.95 us a call and XLA's split merge two kernels of ~1.3 us. The
bytes need ~0.5 us. This probe separates the fixed cost from the per-key cost:

  - CUPTI time of each kernel of one call, by cached length (1, 128, 1,097 tokens) and split
    count (1, 2, 5 and `choose_num_splits`' choice);
  - one profiled call at the e2e shape (Mosaic GPU's in-kernel profiler): per named region of
    the kernel (`copy`, `compute0`, `wait_q`, `wait_k`, `wait_v`, `steps`, `epilogue`), when
    the programs enter it after the first program starts, and how long they stay.

With `--cold` every call first rewrites a 256 MB buffer (one XLA kernel, reported apart), so
that the pages come from HBM, as they do in the model's step, not from the L2. `--batch 16`
gives every call 16 slots of their own pages (B=16's grid of 128 items, one an SM): the trace
then says where a B=16 call's ~23.6 us go (`program_total_median_us`: a region's time in each
program, summed over its steps), which run 165 left open (benchmarks/NOTES.md, session 32).

`--page-size` keeps the table's 1,216 tokens and the pool's 8,192 in pages of another size
(run 179: pages of 64 issue a quarter of the copies, and the call is no faster).

`--fold` times and traces `rope_append_decode_attention` instead (the layer's `rope_append`
inside the kernel: regions `rope` and `new_row` besides), from float32 partial sums of the
projection in 4 parts, the new token at `kv_len - 1` of each slot.

    python -m probes.decode_b1 --out results.json
"""

import argparse
import functools
import glob
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from benchmarks.common import environment, error_text
from pallas_kernels.mosaic import slot_order
from pallas_kernels.mosaic.paged_decode import (
    paged_decode_attention,
    rope_append_decode_attention,
)

HQ, HKV, D, PAGE = 16, 8, 128, 16
TABLE_PAGES = 76  # e2e's B=1 table: 1,216 tokens
NUM_PAGES = 512


def inputs(kv_len: int, seed: int = 0, batch: int = 1, page: int = PAGE):
    """`batch` slots of `kv_len` tokens, each with its own random pages of one pool (pages of
    `page` tokens: the same 1,216-token table and 8,192 pool tokens at any page size)."""
    rng = np.random.default_rng(seed)
    dt = jnp.bfloat16
    table_pages = TABLE_PAGES * PAGE // page
    num_pages = max(NUM_PAGES * PAGE // page, batch * table_pages)
    q = jnp.asarray(rng.standard_normal((batch, HQ, D)), dt)
    k = jnp.asarray(rng.standard_normal((num_pages, page, HKV, D)), dt)
    v = jnp.asarray(rng.standard_normal((num_pages, page, HKV, D)), dt)
    pages = rng.permutation(num_pages)[: batch * table_pages].reshape(batch, table_pages)
    lens = jnp.full((batch,), kv_len, jnp.int32)
    return q, k, v, lens, jnp.asarray(pages, jnp.int32)


def fold_inputs(kv_len: int, seed: int = 0, batch: int = 1, page: int = PAGE):
    """`rope_append_decode_attention`'s arguments for `inputs`' pages: qkv as float32 partial
    sums [4, batch, Hkv, G + 2, D], its angles and the new tokens' slots."""
    _, k, v, lens, table = inputs(kv_len, seed, batch, page)
    rng = np.random.default_rng(seed + 1)
    qkv = jnp.asarray(rng.standard_normal((4, batch, HKV, HQ // HKV + 2, D)), jnp.float32)
    angles = jnp.asarray(rng.uniform(0, 6, (batch, D // 2)), jnp.float32)
    last = kv_len - 1
    slots = table[:, last // page] * page + last % page
    return qkv, jnp.cos(angles), jnp.sin(angles), None, None, k, v, slots, lens, table


def per_kernel_us(fn, *args, iterations=50):
    """Median CUPTI time of each kernel of one call, in launch order: [(name, us)]."""
    jax.block_until_ready(fn(*args))
    _, timings = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    names = [name for name, _ in timings[0]]
    return [
        (name, 1e3 * statistics.median(t[i][1] for t in timings)) for i, name in enumerate(names)
    ]


def timeline(path, sm_ghz=1.98):
    """Per named region of one profiled call: programs, when they enter it after the first
    program starts (median, max; us), and how long they stay (median, max; us).

    A program's timestamps are its start on the global timer (ns) plus SM cycles since then
    (`probes.layer_stream.barrier_trace`); a program's first event stands for its start."""
    with open(path) as f:
        events = sorted(json.load(f)["traceEvents"], key=lambda e: e["ts"])
    start = {}
    for e in events:
        start.setdefault(e["tid"], e["ts"])
    t0 = min(start.values())
    open_, spans = {}, {}
    for e in events:
        real = start[e["tid"]] + (e["ts"] - start[e["tid"]]) / sm_ghz - t0
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_[key] = real
        elif key in open_:
            spans.setdefault(e["name"], []).append((e["tid"], open_.pop(key), real))
    report = {"program_start_spread_us": max(start.values()) - t0}
    for name, s in sorted(spans.items()):
        enter = [a for _, a, _ in s]
        stay = [b - a for _, a, b in s]
        per_program = {}
        for tid, a, b in s:  # a region entered once a step: its whole time in each program
            per_program[tid] = per_program.get(tid, 0.0) + b - a
        report[name] = dict(
            spans=len(s),
            enter_median_us=statistics.median(enter),
            enter_max_us=max(enter),
            stay_median_us=statistics.median(stay),
            stay_max_us=max(stay),
            leave_max_us=max(b for _, _, b in s),
            program_total_median_us=statistics.median(per_program.values()),
        )
    return report


def fold(*args, **options):
    """`rope_append_decode_attention`'s attention output (the pages are updated in place)."""
    return rope_append_decode_attention(*args, **options)[:2]


def cold(fn):
    """`fn` after a kernel that rewrites a 256 MB buffer: the L2 (60 MB) holds none of fn's
    inputs."""
    return jax.jit(lambda big, *args: (big + 1, fn(*args)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-lens", type=int, nargs="+", default=[1, 128, 1097])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 5], help="0: default")
    parser.add_argument("--cold", action="store_true", help="inputs evicted from the L2")
    parser.add_argument(
        "--ranked", action="store_true", help="rank the slots in the kernel (before session 28)"
    )
    parser.add_argument(
        "--batch", type=int, default=1, help="slots of the traced call (B=16: a grid of 128 items)"
    )
    parser.add_argument("--page-size", type=int, default=PAGE, help="tokens a page")
    parser.add_argument("--fold", action="store_true", help="rope_append inside the kernel")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.ranked:  # the rule before session 28: a grid of items always ranked its slots
        slot_order.choose = lambda config, items_per_sm, num_seq_slots: (
            "kernel" if config.longest_first else None
        )
    big = jnp.zeros((2**27,), jnp.bfloat16) if args.cold else None
    wrap = cold if args.cold else jax.jit
    prefix = (big,) if args.cold else ()
    cases = []
    for kv_len in args.kv_lens:
        for splits in args.splits:
            case = dict(case="cupti", kv_len=kv_len, splits=splits or "default", cold=args.cold)
            case["page_size"] = args.page_size
            case["ranked"] = args.ranked
            case["fold"] = args.fold
            if args.fold:  # the split rule's own count only
                fn = wrap(functools.partial(fold, eps=1e-6, sm_scale=D**-0.5))
            else:
                fn = wrap(
                    functools.partial(
                        paged_decode_attention, num_splits=splits or None, sm_scale=D**-0.5
                    )
                )
            make = fold_inputs if args.fold else inputs
            try:
                kernels = per_kernel_us(
                    fn, *prefix, *make(kv_len, batch=args.batch, page=args.page_size)
                )
                case["kernels"] = kernels
                # --cold's buffer rewrite (~120 us) is not the call's.
                flush = [us for name, us in kernels if us > 50 and "mosaic" not in name]
                case["total_us"] = sum(us for _, us in kernels) - sum(flush)
            except Exception as e:  # noqa: BLE001 - a probe records and goes on
                case["error"] = error_text(e)
            print(json.dumps(case), flush=True)
            cases.append(case)
    with tempfile.TemporaryDirectory() as directory:
        call = functools.partial(fold, eps=1e-6) if args.fold else paged_decode_attention
        fn = wrap(functools.partial(call, sm_scale=D**-0.5, profile_dir=directory))
        make = fold_inputs if args.fold else inputs
        for _ in range(3):  # the last of three calls: compiled, and the L2 as --cold asks
            jax.block_until_ready(fn(*prefix, *make(1097, batch=args.batch, page=args.page_size)))
        path = sorted(glob.glob(os.path.join(directory, "*.json")), key=os.path.getmtime)[-1]
        trace = dict(
            case="trace",
            kv_len=1097,
            batch=args.batch,
            cold=args.cold,
            page_size=args.page_size,
            fold=args.fold,
        )
        trace.update(timeline(path))
        print(json.dumps(trace), flush=True)
        cases.append(trace)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="decode_b1", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
