"""Probe: the Mosaic decode projection (`pallas_kernels.mosaic.projection`) against XLA, per
projection of the `1b` decoder, at the rows of decode batches 1 (two rows), 16 and 64.

Each case runs 16 layers' worth of calls, each on its own weights (beyond the L2 together),
and reports CUPTI time per layer summed over every kernel of a call (XLA's split-K sums and
SwiGLU's multiply included; the kernel's semaphore zeroing too), the kernels per layer and
their names, and the kernel's error against a float32 product of the same inputs next to
XLA's own.

    python -m probes.projection --out results.json
"""

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, error_text
from models.engine import SMALL_STEP_XLA_OPTIONS
from pallas_kernels.mosaic.projection import TILE_N, ProjectionConfig, projection

LAYERS = 16
SHAPES = {  # name: (K, N, activation)
    "qkv": (2048, 4096, None),
    "o": (2048, 2048, None),
    "gate_up": (2048, 12288, "swiglu"),
    "down": (6144, 2048, None),
}


def reference(x, w, activation, dtype):
    """XLA: the product (and SwiGLU over gate / up blocks of TILE_N columns) in `dtype`."""
    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if activation == "swiglu":
        k, n = w.shape
        blocks = y.reshape(y.shape[0], n // (2 * TILE_N), 2, TILE_N)
        gate, up = blocks[:, :, 0], blocks[:, :, 1]
        if dtype != jnp.float32:  # XLA's path rounds the product before the activation
            gate, up = gate.astype(dtype).astype(jnp.float32), up.astype(dtype).astype(jnp.float32)
        y = (jax.nn.silu(gate) * up).reshape(y.shape[0], -1)
    return y.astype(dtype)


def kernel_times(fn, *args, iterations=20):
    """(median ms of all kernels of a call, [(name, ms)] of one call) under CUPTI."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    _, per_iter = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    totals = [sum(t for _, t in kernels) for kernels in per_iter]
    return statistics.median(totals), per_iter[len(per_iter) // 2]


def chain_case(rows, name, fn, repeats=50, graphs=False):
    """16 layers of o -> gate_up (SwiGLU) -> down, each layer's input the last one's output:
    CUPTI time and wall time (calls in flight, one sync) per layer; `graphs`: compiled with
    the engine's small-step options (every kernel in a command buffer, as in a decode step)."""
    keys = jax.random.split(jax.random.key(7), 3 * LAYERS)
    shapes = [SHAPES[s][:2] for s in ("o", "gate_up", "down")]
    layers = [
        [
            0.02 * jax.random.normal(keys[3 * i + j], shape, jnp.bfloat16)
            for j, shape in enumerate(shapes)
        ]
        for i in range(LAYERS)
    ]

    def layer_chain(x, layers):
        for w_o, w_gu, w_down in layers:
            x = fn(fn(fn(x, w_o), w_gu, activation="swiglu"), w_down)
        return x

    options = dict(SMALL_STEP_XLA_OPTIONS) if graphs else None
    chain = jax.jit(layer_chain, compiler_options=options)
    x = jax.random.normal(jax.random.key(rows), (rows, 2048), jnp.bfloat16)
    case = dict(chain="o,gate_up,down", impl=name, rows=rows, graphs=graphs)
    try:
        ms, kernels = kernel_times(chain, x, layers)
        case["gpu_us_per_layer"] = ms * 1e3 / LAYERS
        case["kernels_per_layer"] = len(kernels) / LAYERS
        jax.block_until_ready(chain(x, layers))
        start = time.perf_counter()
        outs = [chain(x, layers) for _ in range(repeats)]
        jax.block_until_ready(outs)
        case["wall_us_per_layer"] = (time.perf_counter() - start) / repeats / LAYERS * 1e6
    except Exception as e:  # noqa: BLE001 - a probe records and goes on
        case["error"] = error_text(e)
    print(json.dumps(case), flush=True)
    return case


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument(
        "--configs", nargs="+", default=["128,4"], help="tile_k,num_stages[,pdl] of the kernel"
    )
    parser.add_argument("--chain", action="store_true", help="also the dependent layer chain")
    parser.add_argument("--graphs", action="store_true", help="the chain in command buffers")
    args = parser.parse_args()
    cases = []
    if args.chain:
        for rows in args.rows:
            cases.append(
                chain_case(
                    rows,
                    "xla",
                    lambda x, w, activation=None: reference(x, w, activation, x.dtype),
                    graphs=args.graphs,
                )
            )
            for spec in args.configs:
                tile_k, stages, *pdl = spec.split(",")
                config = ProjectionConfig(tile_k=int(tile_k), num_stages=int(stages), pdl=bool(pdl))
                fn = functools.partial(projection, config=config)
                cases.append(chain_case(rows, f"mosaic {spec}", fn, graphs=args.graphs))
    for shape in args.shapes:
        k, n, activation = SHAPES[shape]
        keys = jax.random.split(jax.random.key(0), LAYERS)
        ws = [0.02 * jax.random.normal(kk, (k, n), jnp.bfloat16) for kk in keys]
        for rows in args.rows:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            want = np.asarray(reference(x, ws[0], activation, jnp.float32))
            scale = float(np.max(np.abs(want)))
            variants = [("xla", functools.partial(reference, activation=activation, dtype=x.dtype))]
            for spec in args.configs:
                tile_k, stages, *pdl = spec.split(",")
                config = ProjectionConfig(tile_k=int(tile_k), num_stages=int(stages), pdl=bool(pdl))
                variants.append(
                    (
                        f"mosaic tile_k={tile_k} stages={stages}{' pdl' if pdl else ''}",
                        functools.partial(projection, activation=activation, config=config),
                    )
                )
            for name, fn in variants:
                case = dict(shape=shape, impl=name, rows=rows)
                try:
                    layered = jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws])
                    ms, kernels = kernel_times(layered, x, ws)
                    case["us"] = ms * 1e3 / LAYERS
                    case["tb_s"] = k * n * 2 / case["us"] / 1e6
                    case["kernels_per_layer"] = len(kernels) / LAYERS
                    case["kernel_names"] = sorted({name for name, _ in kernels})
                    got = np.asarray(fn(x, ws[0]).astype(jnp.float32))
                    case["max_err"] = float(np.max(np.abs(got - want))) / scale
                    case["nan"] = bool(np.isnan(got).any())
                except Exception as e:  # noqa: BLE001 - a probe records and goes on
                    case["error"] = error_text(e)
                print(json.dumps(case), flush=True)
                cases.append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="projection", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
