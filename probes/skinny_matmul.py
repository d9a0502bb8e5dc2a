"""Probe: how fast does a Mosaic GPU TMA + `wgmma` pipeline stream a decode step's projection
weights, against XLA's GEMMs at the same shapes?

JAX's Hopper matmul (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, persistent over
output tiles, no split-K) at M = 64 rows (its smallest tile), on weights [K / S, S * N]: the
bytes of the projection's [K, N] weights laid out as S K-splits side by side, so that the
kernel has S times the output tiles a split-K kernel would have (the sum over splits is not
done: this measures streaming only). XLA's `x @ w` at M = 2 and 64 on the [K, N] weights for
reference. Each case runs 16 calls on 16 weights of its own (beyond the L2 together); CUPTI
time of all kernels / 16.

    python -m probes.skinny_matmul --out results.json
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.common import environment, error_text, kernel_time_ms

LAYERS = 16
SHAPES = {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)}


def weights(k, n):
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return [0.02 * jax.random.normal(kk, (k, n), jnp.bfloat16) for kk in keys]


def case(fn, x, ws):
    us = kernel_time_ms(jax.jit(lambda x, ws: [fn(x, w) for w in ws]), x, ws) * 1e3 / LAYERS
    nbytes = ws[0].size * 2
    return dict(us=us, tb_s=nbytes / us / 1e6)


def main():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tile-n", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--steps", type=int, nargs="+", default=[4])
    parser.add_argument("--budget-s", type=float, default=240)
    args = parser.parse_args()
    start, results = time.time(), []

    def record(**c):
        print(json.dumps(c), flush=True)
        results.append(c)

    for shape in args.shapes:
        k, n = SHAPES[shape]
        for rows in (2, 64):
            x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
            try:
                record(shape=shape, impl="xla", rows=rows, **case(jnp.matmul, x, weights(k, n)))
            except Exception as e:  # noqa: BLE001 - a probe records and goes on
                record(shape=shape, impl="xla", rows=rows, error=error_text(e))
        for splits in args.splits:
            ws = weights(k // splits, n * splits)
            x = jax.random.normal(jax.random.key(1), (64, k // splits), jnp.bfloat16)
            for tile_n in args.tile_n:
                for steps in args.steps:
                    info = dict(shape=shape, impl="mosaic", rows=64, splits=splits)
                    info.update(tile_n=tile_n, steps=steps)
                    if time.time() - start > args.budget_s:
                        record(**info, skipped="budget")
                        continue
                    config = hm.TuningConfig(
                        tile_m=64,
                        tile_n=tile_n,
                        tile_k=64,
                        max_concurrent_steps=steps,
                        epi_tile_n=min(64, tile_n),
                        epi_tile_m=64,
                    )
                    try:
                        got = case(lambda x, w, c=config: hm.matmul(x, w, None, c), x, ws)
                        want = (x @ ws[0]).astype(jnp.float32)
                        err = jnp.max(jnp.abs(hm.matmul(x, ws[0], None, config) - want))
                        record(**info, **got, max_err=float(err))
                    except Exception as e:  # noqa: BLE001
                        record(**info, error=error_text(e))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="skinny_matmul", cases=results), f, indent=1)


if __name__ == "__main__":
    main()
