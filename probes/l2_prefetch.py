"""Probe: do a decode step's projections run faster when the latency-bound kernel before them
has pulled their weights into the L2 with programs of its own?

A chain of 16 layers, each with its own weights (beyond the L2 all together), each
`add_rms_norm` -> `normed @ w` -> next layer's residual, at M rows. Variants: the norm kernel
as main has it, and the same kernel with extra programs that read the first `fraction` of the
next projection's weights (loads kept alive by a sum stored per program). CUPTI per kernel
kind / 16 layers.

    python -m probes.l2_prefetch --out results.json
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.common import environment, error_text

LAYERS = 16
SHAPES = {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)}


def norm_prefetch(x, h, scale, w, *, fraction, block_elems, eviction, eps=1e-6, interpret=False):
    num_rows, hidden = x.shape
    block = pl.next_power_of_2(hidden)
    flat = w.reshape(-1) if w is not None else jnp.zeros((1,), x.dtype)
    n_pref = int(flat.shape[0] * fraction) // block_elems if w is not None else 0
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2 + [
        jax.ShapeDtypeStruct((max(n_pref, 1),), jnp.float32)
    ]

    def kernel(x_ref, h_ref, s_ref, w_ref, sum_ref, normed_ref, sink_ref):
        pid = pl.program_id(0)

        @pl.when(pid < num_rows)
        def _():
            cols = jnp.arange(block, dtype=jnp.int32)
            ok = cols < hidden
            xv = plgpu.load(x_ref.at[pid, cols], mask=ok, other=0).astype(jnp.float32)
            hv = plgpu.load(h_ref.at[pid, cols], mask=ok, other=0).astype(jnp.float32)
            total = (xv + hv).astype(sum_ref.dtype)
            plgpu.store(sum_ref.at[pid, cols], total, mask=ok)
            t = total.astype(jnp.float32)
            r = lax.rsqrt(jnp.sum(t * t) / hidden + eps)
            s = plgpu.load(s_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
            plgpu.store(normed_ref.at[pid, cols], (t * (r * s)).astype(normed_ref.dtype), mask=ok)

        if n_pref:

            @pl.when(pid >= num_rows)
            def _():
                i = pid - num_rows
                idx = i * block_elems + jnp.arange(block_elems, dtype=jnp.int32)
                v = plgpu.load(w_ref.at[idx], eviction_policy=eviction)
                sink_ref[i] = jnp.sum(v.astype(jnp.float32))

    warps = min(8, max(1, block // 512))
    return pl.pallas_call(
        kernel,
        grid=(num_rows + n_pref,),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(x, h, scale, flat)[:2]


def chain(rows, shape, fraction, block_elems, eviction):
    k, n = shape

    def run(ws, x, h, scale):
        def layer(carry, w):
            x, h = carry
            if fraction:
                s, normed = norm_prefetch(
                    x, h, scale, w, fraction=fraction, block_elems=block_elems, eviction=eviction
                )
            else:
                s, normed = norm_prefetch(
                    x, h, scale, None, fraction=0, block_elems=1, eviction=None
                )
            y = normed @ w
            h = jnp.tile(y, (1, -(-k // n)))[:, :k] if n < k else y[:, :k]
            return (s, h), None

        # Separate arrays, not a stacked one: a slice of a stack is a copy when it feeds a
        # custom call, and the copy would bring the weights into the L2 itself.
        for w in ws:
            (x, h), _ = layer((x, h), w)
        return x + h

    keys = jax.random.split(jax.random.key(0), 4)
    wkeys = jax.random.split(keys[0], LAYERS)
    ws = [0.02 * jax.random.normal(kk, (k, n), jnp.bfloat16) for kk in wkeys]
    x = jax.random.normal(keys[1], (rows, k), jnp.bfloat16)
    h = jax.random.normal(keys[2], (rows, k), jnp.bfloat16)
    scale = 1 + 0.1 * jax.random.normal(keys[3], (k,), jnp.bfloat16)
    return jax.jit(run), (ws, x, h, scale)


def _kind(name):
    if "add_rms_norm" in name:
        return "norm"
    if any(s in name for s in ("gemm", "cutlass", "sm90", "xmma", "triton_gemm", "dot")):
        return "gemm"
    return "other"


def profile(fn, args, iterations=10):
    from jax._src.lib import mosaic_gpu

    ext = mosaic_gpu._mosaic_gpu_ext
    jax.block_until_ready(fn(*args))
    ext._cupti_init()
    jax.block_until_ready(fn(*args))
    ext._cupti_get_timings(True)  # the first capture may miss kernels
    ext._cupti_init()
    for _ in range(iterations):
        jax.block_until_ready(fn(*args))
    timings = ext._cupti_get_timings(True)
    by_kind, names = {}, {}
    for name, ms in timings:
        by_kind[_kind(name)] = by_kind.get(_kind(name), 0.0) + ms
        names[name[:50]] = names.get(name[:50], 0.0) + ms
    per = iterations * LAYERS
    top = sorted(names.items(), key=lambda kv: -kv[1])[:6]
    return dict(
        us_per_layer=1e3 * sum(by_kind.values()) / per,
        by_kind_us={k: round(1e3 * v / per, 3) for k, v in by_kind.items()},
        kernels_per_layer=len(timings) / per,
        top=[(name, round(1e3 * v / per, 3)) for name, v in top],
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--fractions", type=float, nargs="+", default=[0, 0.25, 0.5, 1.0])
    parser.add_argument("--block-elems", type=int, nargs="+", default=[16384])
    parser.add_argument("--eviction", nargs="+", default=["evict_last"])
    args = parser.parse_args()
    results = []
    for rows in args.rows:
        for shape in args.shapes:
            for fraction in args.fractions:
                for block_elems in args.block_elems if fraction else [0]:
                    for eviction in args.eviction if fraction else [None]:
                        case = dict(
                            rows=rows,
                            shape=shape,
                            fraction=fraction,
                            block_elems=block_elems,
                            eviction=eviction,
                        )
                        t = time.perf_counter()
                        try:
                            fn, fargs = chain(rows, SHAPES[shape], fraction, block_elems, eviction)
                            case.update(profile(fn, fargs))
                        except Exception as e:  # noqa: BLE001 - a probe records and goes on
                            case["error"] = error_text(e)
                        case["seconds"] = round(time.perf_counter() - t, 1)
                        print(json.dumps(case), flush=True)
                        results.append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment(), cases=results), f, indent=1)


if __name__ == "__main__":
    main()
