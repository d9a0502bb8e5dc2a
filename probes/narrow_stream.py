"""Probe: can a decode projection stream its weights at the layer stream's ~3.8 TB/s with the
activations as `wgmma`'s A (M=64, T <= 16 real rows) and each program owning a narrow run of
output columns over all of K (benchmarks/NOTES.md, "Session 27")?

A persistent layer kernel needs each phase's outputs whole where the next phase reads them:
the norm after o and down reads the full row, and SwiGLU needs its gate and up columns summed
over K. With the weights as the M (runs 99-101, 133-141) a program's tile is 64 output columns,
so o and down (32 tiles of 64) must split K over ~4 programs to fill 132 SMs, and the splits'
partials need a sum, a counter or another barrier. With x as the A and the weights as the B,
a tile's N can be 16, and 128 programs can each own whole columns of every phase: o and down
16 columns, qkv 32, gate/up 48 + 48. Nothing is split, nothing is summed.

The weights are stored unit-major, `[units, K, N_u]`, so that a program's share is contiguous
and every TMA box ([tile_k, N_u]) is one contiguous run of bytes. x [R, K] (R = 8 or 16) comes
in by TMA per K step as a 64-row box, whose rows past R TMA fills with zeros (no bytes read),
and each step is one `wgmma`.

Cases (16 layers, each with its own weights, CUPTI, us a layer): the four phases of the `1b`
layer as separate calls, in the modes of `narrow`. Compare them with the step's own GEMMs
(`e2e --profile --top-kernels`): XLA merges this probe's 16 dots of one x into one (`xla`,
not a default, measures that).

    python -m probes.narrow_stream --rows 2 16 --out results.json
"""

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text, kernel_time_ms

HIDDEN, INTER = 2048, 6144
# (name, K, N, N_u): 128 units a phase, so that every one of 128 programs owns one.
PHASES = (
    ("qkv", HIDDEN, 4096, 32),
    ("o", HIDDEN, HIDDEN, 16),
    ("gate_up", HIDDEN, 2 * INTER, 96),
    ("down", INTER, HIDDEN, 16),
)
LAYERS = 16
TILE_M = 64


def _tiled(n_u: int):
    swizzle = min(128, n_u * 2)
    while swizzle > 32 and (n_u * 2) % swizzle:
        swizzle //= 2
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)), swizzle


def narrow(x, w, *, tile_k=256, stages=8, mode="chunked", chunk=512):
    """w [U, K, N_u] -> y [R, U * N_u] bf16: program u computes columns [u * N_u, (u + 1) * N_u)
    of x @ w over all of K (R a multiple of 8, at most 64).

    `mode` is how x reaches `wgmma`'s 64-row A:
      - "box": x [R, K], a 64-row TMA box each K step (TMA fills rows R-63 with zeros);
      - "chunked": x [K // tile_k, R, tile_k] (the K steps leading), `chunk` columns at a
        time by TMA into rows [0, R) of two [chunk // tile_k, 64, tile_k] buffers whose other
        rows stay zero, the next chunk copied while this one's steps run;
      - "weights_only" (timing only, wrong numbers): every step's A is one zeroed buffer, so
        that only the weights stream."""
    units, k, n_u = w.shape
    rows = x.shape[-2]
    assert k % chunk == 0 and chunk % tile_k == 0 and rows % 8 == 0 and rows <= TILE_M
    transforms, _ = _tiled(n_u)
    per_chunk, num_chunks = chunk // tile_k, k // chunk

    def body(x_ref, w_ref, y_ref, y_smem, a_smem, x_ready):
        unit = lax.axis_index("program")
        zeros = plgpu.layout_cast(jnp.zeros((TILE_M, tile_k), x.dtype), plgpu.Layout.WGMMA)
        if mode == "weights_only":
            a_smem[...] = zeros
            plgpu.commit_smem()
        if mode == "chunked":
            for b, j in itertools.product(range(2), range(per_chunk)):
                a_smem.at[b, j][...] = zeros
            plgpu.commit_smem()

            def copy_chunk(c, b):  # one copy a K step: rows [0, R) of a tile are contiguous
                for j in range(per_chunk):
                    plgpu.copy_gmem_to_smem(
                        x_ref.at[c * per_chunk + j],
                        a_smem.at[b, j, pl.ds(0, rows)],
                        x_ready.at[b],
                    )

            copy_chunk(0, 0)

        def step(indices, *refs):
            (i,) = indices
            *x_smem, w_smem, acc = refs
            if mode == "box":
                a = x_smem[0]
            elif mode == "weights_only":
                a = a_smem
            else:
                c, j = i // per_chunk, lax.rem(i, per_chunk)
                b = lax.rem(c, 2)

                @pl.when(j == 0)
                def _():
                    plgpu.barrier_wait(x_ready.at[b])

                    @pl.when(c + 1 < num_chunks)
                    def _():
                        copy_chunk(c + 1, 1 - b)

                a = a_smem.at[b, j]

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, a, w_smem.at[0])

            return pl.run_state(mma)(plgpu.ACC.init(acc))

        zero = plgpu.layout_cast(jnp.zeros((TILE_M, n_u), jnp.float32), plgpu.Layout.WGMMA)
        x_spec = plgpu.BlockSpec((TILE_M, tile_k), lambda i: (0, i), transforms=transforms)
        w_spec = plgpu.BlockSpec((1, tile_k, n_u), lambda i: (unit, i, 0), transforms=transforms)
        box = mode == "box"
        acc = plgpu.emit_pipeline(
            step,
            grid=(k // tile_k,),
            in_specs=[x_spec, w_spec] if box else [w_spec],
            max_concurrent_steps=stages,
            init_carry=zero,
        )(*((x_ref, w_ref) if box else (w_ref,)))
        y_smem[...] = acc.astype(y_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem.at[pl.ds(0, rows)], y_ref.at[:, pl.ds(unit * n_u, n_u)])
        plgpu.wait_smem_to_gmem(0)

    a_shape = {"box": (8,), "weights_only": (TILE_M, tile_k)}.get(
        mode, (2, per_chunk, TILE_M, tile_k)
    )
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, units * n_u), x.dtype),
        grid=(units,),
        grid_names=("program",),
        scratch_types=(
            plgpu.SMEM((TILE_M, n_u), x.dtype),
            plgpu.SMEM(a_shape, x.dtype, transforms=() if mode == "box" else transforms),
            plgpu.Barrier(num_arrivals=per_chunk, num_barriers=2),
        ),
    )(x, w)


def chunked_x(x, tile_k):
    """[R, K] -> [K // tile_k, R, tile_k], the layout `narrow(mode="chunked")` copies."""
    rows, k = x.shape
    return x.reshape(rows, k // tile_k, tile_k).transpose(1, 0, 2)


def unit_major(w, n_u):
    """[K, N] -> [N // n_u, K, n_u]: each program's columns contiguous."""
    k, n = w.shape
    return w.reshape(k, n // n_u, n_u).transpose(1, 0, 2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--stages", type=int, nargs="+", default=[8])
    parser.add_argument("--tile-k", type=int, nargs="+", default=[256])
    parser.add_argument("--phases", nargs="+", default=[p[0] for p in PHASES])
    parser.add_argument("--cases", nargs="+", default=["chunked", "weights_only"])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--out")
    args = parser.parse_args()
    keys = map(functools.partial(jax.random.fold_in, jax.random.key(0)), itertools.count())
    dt = jnp.bfloat16
    cases = []
    for name, k, n, n_u in PHASES:
        if name not in args.phases:
            continue
        ws = [jax.random.normal(next(keys), (k, n), dt) / k**0.5 for _ in range(LAYERS)]
        wus = [unit_major(w, n_u) for w in ws]
        for rows in args.rows:
            padded = max(8, -(-rows // 8) * 8)
            x = jax.random.normal(next(keys), (padded, k), dt)
            want = jnp.dot(x[:rows], ws[0], preferred_element_type=jnp.float32)
            xla = jax.jit(lambda x, ws: [jnp.dot(x, w) for w in ws])
            base = dict(phase=name, rows=rows, mb=k * n * 2 / 1e6)
            if "xla" in args.cases:
                us = kernel_time_ms(xla, x[:rows], ws) * 1e3 / LAYERS
                case = dict(base, case="xla", us=us, tb_s=k * n * 2 / us / 1e6)
                print(json.dumps(case), flush=True)
                cases.append(case)
            configs = itertools.product(
                [c for c in args.cases if c != "xla"], args.stages, args.tile_k
            )
            for name_, stages, tile_k in configs:
                case = dict(base, case=name_, stages=stages, tile_k=tile_k, chunk=args.chunk)
                kw = dict(tile_k=tile_k, stages=stages, mode=name_, chunk=args.chunk)
                xin = chunked_x(x, tile_k) if name_ == "chunked" else x
                try:
                    fn = jax.jit(lambda x, wus, kw=kw: [narrow(x, w, **kw) for w in wus])
                    if name_ != "weights_only":
                        got = fn(xin, wus)[0][:rows].astype(jnp.float32)
                        case["max_rel_error"] = float(
                            jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))
                        )
                    us = kernel_time_ms(fn, xin, wus) * 1e3 / LAYERS
                    case.update(us=us, tb_s=k * n * 2 / us / 1e6)
                except Exception as e:  # noqa: BLE001 - a probe records and goes on
                    case["error"] = error_text(e)
                print(json.dumps(case), flush=True)
                cases.append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="narrow_stream", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
