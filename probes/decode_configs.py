"""Probe (runs 87, 94-96): the decode kernels at the `1b` decoder's attention shape, per config.

The e2e decode step's attention (Hq=16, Hkv=8, D=128, page 16, ~1,110 cached tokens, 81
pages a slot) took 7.1 / 23.8 / 77.4 us a layer at B=1 / 16 / 64 (run 86), 16% above what
run 44 measured for the op alone at B=64 (a different shape: run 94 found the op alone at
this one as slow as in the step). Each case calls the kernel on 16 pools of its own
(as the 16 layers do; beyond the L2 at every batch), kv_lens drawn from the decode window,
each slot's pages a random permutation of its pool: CUPTI time of all kernels (the split
merge included) / 16, per Mosaic config and split count, for the Triton kernel and for cuDNN
paged (run 96). `--ordered-pages` gives each slot its pages in order, as a fresh pool does;
`--page-size` changes the page (the same tokens a slot).

    python -m probes.decode_configs --out results.json
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, error_text, kernel_time_ms
from benchmarks.inputs import cudnn_decode_fn
from pallas_kernels.mosaic import paged_decode as mosaic
from pallas_kernels.triton import paged_decode as triton

LAYERS, HQ, HKV, D, PAGE, PAGES_PER_SEQ = 16, 16, 8, 128, 16, 81


def inputs(batch, seed=0, ordered=False, page=PAGE):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1040, 1181, size=batch)
    pages_per_seq = -(-PAGES_PER_SEQ * PAGE // page)
    pool = batch * pages_per_seq
    order = (lambda: np.arange(pool)) if ordered else (lambda: rng.permutation(pool))
    tables = np.stack([order().reshape(batch, pages_per_seq) for _ in range(LAYERS)])
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (LAYERS, pool, page, HKV, D)
    q = jax.random.normal(keys[0], (LAYERS, batch, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], shape, jnp.bfloat16)
    v = jax.random.normal(keys[2], shape, jnp.bfloat16)
    kv_bytes = int(lens.sum()) * HKV * D * 2 * 2
    return (q, k, v, jnp.asarray(lens, jnp.int32), jnp.asarray(tables, jnp.int32)), kv_bytes


def layered(attend):
    def fn(q, k, v, lens, tables):
        return [attend(q[i], k[i], v[i], lens, tables[i]) for i in range(LAYERS)]

    return jax.jit(fn)


def variants(batch):
    yield "mosaic default", lambda *a: mosaic.paged_decode_attention(*a, sm_scale=D**-0.5)[0]
    splits = (1, 2, 4) if batch > 1 else (4, 8, 16)
    for s in splits:
        yield (
            f"mosaic splits={s}",
            lambda *a, s=s: mosaic.paged_decode_attention(*a, sm_scale=D**-0.5, num_splits=s)[0],
        )
    for block_kv, stages in ((64, 2), (64, 3), (64, 4), (128, 3)):
        config = mosaic.MosaicDecodeConfig(block_kv=block_kv, num_stages=stages)
        yield (
            f"mosaic block_kv={block_kv} stages={stages}",
            lambda *a, c=config: mosaic.paged_decode_attention(*a, sm_scale=D**-0.5, config=c)[0],
        )
    config = mosaic.MosaicDecodeConfig(persistent=False)
    yield (
        "mosaic not persistent",
        lambda *a: mosaic.paged_decode_attention(*a, sm_scale=D**-0.5, config=config)[0],
    )
    yield "triton default", lambda *a: triton.paged_decode_attention(*a, sm_scale=D**-0.5)[0]
    yield "cudnn", cudnn_decode_fn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--variants", nargs="*", default=None, help="only these (by name)")
    parser.add_argument("--page-size", type=int, default=PAGE)
    parser.add_argument(
        "--ordered-pages", action="store_true", help="each slot's pages in order, as a fresh pool's"
    )
    args = parser.parse_args()
    start, cases = time.time(), []
    for batch in args.batches:
        xs, kv_bytes = inputs(batch, ordered=args.ordered_pages, page=args.page_size)
        for name, attend in variants(batch):
            if args.variants is not None and name not in args.variants:
                continue
            if time.time() - start > args.budget_s:
                cases.append(dict(batch=batch, variant=name, skipped="budget"))
                continue
            try:
                us = kernel_time_ms(layered(attend), *xs) * 1e3 / LAYERS
                case = dict(batch=batch, page=args.page_size, variant=name, us=us)
                case["tb_s"] = kv_bytes / us / 1e6
            except Exception as e:  # noqa: BLE001 - a probe records the failure and goes on
                case = dict(batch=batch, variant=name, error=error_text(e))
            print(json.dumps(case), flush=True)
            cases.append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="decode_configs", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
