"""Probe (written in session 17, not yet run): does a stream-K walk stream a decode step's
projection weights at the HBM rate from every SM?

Run 97 found JAX's Hopper Mosaic matmul at M=64 streaming at ~33 GB/s per busy SM but leaving
SMs idle (gate/up: 96 output tiles of 128 columns for 132 SMs; 3.17 TB/s). Here every program
takes an equal share of the (output tile, K step) iterations, contiguous, so that each SM reads
the same bytes: one `emit_pipeline` of TMA copies (x [64, 64] and w [64, 128] per step) and a
`wgmma` per step, the f32 accumulator flushed to a partial output at each tile's end and at the
share's end (a share spans at most two tiles at these shapes). The fix-up sum of the partials
of tiles split between programs is done here on the host, for the check only; a kernel would
do it with a GMEM semaphore (`probes/grid_barrier.py`). CUPTI time against XLA's `x @ w` on the
same 16 weights (beyond the L2 together), per projection of the `1b` decoder.

    python -m probes.stream_k --out results.json
"""

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text, kernel_time_ms
from pallas_kernels.common import device_num_sms

LAYERS, ROWS, TILE_K, TILE_N, SWIZZLE = 16, 64, 64, 128, 128
SHAPES = {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)}
TRANSFORMS = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


def shares(k: int, n: int, num_programs: int):
    """(first iteration, count) of each program; iteration i is (tile i // k_steps, K step
    i % k_steps)."""
    total = (n // TILE_N) * (k // TILE_K)
    bounds = [p * total // num_programs for p in range(num_programs + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


def stream_k_matmul(x, w, num_programs: int, stages: int = 4):
    """Partials f32[P, 2, ROWS, TILE_N]: program p's accumulator for the first and second tile
    its share touches (zeros where it touches one)."""
    k, n = w.shape
    k_steps, total = k // TILE_K, (n // TILE_N) * (k // TILE_K)
    max_count = -(-total // num_programs)

    def body(x_ref, w_ref, out_ref, o_smem):
        p = lax.axis_index("program")
        first = p * total // num_programs
        count = (p + 1) * total // num_programs - first

        def it(i):  # the global iteration of pipeline step i (clamped into the share)
            return first + jnp.minimum(i, count - 1)

        def flush(acc, seg):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[p, seg])
            plgpu.wait_smem_to_gmem(0)

        def step(indices, x_smem, w_smem, carry):
            (i,) = indices
            acc, seg = carry
            g = it(i)
            live = i < count

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem)

            # Mosaic's select takes no scalar predicate: compare a row iota with 0 or ROWS.
            row = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA)
            acc = jnp.where(
                row < jnp.where(live, ROWS, 0), pl.run_state(mma)(plgpu.ACC.init(acc)), acc
            )
            ends = live & ((lax.rem(g, k_steps) == k_steps - 1) | (i == count - 1))

            @pl.when(ends)
            def _():
                flush(acc, jnp.minimum(seg, 1))

            acc = jnp.where(row < jnp.where(ends, 0, ROWS), acc, jnp.zeros_like(acc))
            return acc, seg + ends.astype(jnp.int32)

        acc0 = plgpu.layout_cast(jnp.zeros((ROWS, TILE_N), jnp.float32), plgpu.Layout.WGMMA)
        plgpu.emit_pipeline(
            step,
            grid=(max_count,),
            in_specs=[
                plgpu.BlockSpec(
                    (ROWS, TILE_K), lambda i: (0, lax.rem(it(i), k_steps)), transforms=TRANSFORMS
                ),
                plgpu.BlockSpec(
                    (TILE_K, TILE_N),
                    lambda i: (lax.rem(it(i), k_steps), it(i) // k_steps),
                    transforms=TRANSFORMS,
                ),
            ],
            max_concurrent_steps=stages,
            init_carry=(acc0, jnp.int32(0)),
        )(x_ref, w_ref)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_programs, 2, ROWS, TILE_N), jnp.float32),
        grid=(num_programs,),
        grid_names=("program",),
        scratch_types=(plgpu.SMEM((ROWS, TILE_N), jnp.float32),),
    )(x, w)


def stream_k_swap_ab(
    x, w, num_programs: int, *, tile_n: int = 64, tile_k: int = 64, stages: int = 6
):
    """The same walk with the operands swapped for few rows: `wgmma` computes out^T, the
    weights' [tile_k, tile_n] tile (transposed) as A (its M = tile_n output columns) and x's
    [rows, tile_k] tile (transposed) as B (N = rows, a multiple of 8), so that rows need no
    padding to 64. Partials f32[P, segments, tile_n, rows]: out^T of each tile a share touches."""
    rows = -(-x.shape[0] // 8) * 8  # the block: rows past x's are read as zeros (TMA)
    k, n = w.shape
    k_steps, total = k // tile_k, (n // tile_n) * (k // tile_k)
    max_count = -(-total // num_programs)
    segments = -(-max_count // k_steps) + 1

    def body(x_ref, w_ref, out_ref, o_smem):
        p = lax.axis_index("program")
        first = p * total // num_programs
        count = (p + 1) * total // num_programs - first

        def it(i):
            return first + jnp.minimum(i, count - 1)

        def step(indices, x_smem, w_smem, carry):
            (i,) = indices
            acc, seg = carry
            g = it(i)
            live = i < count

            def mma(acc_ref):
                plgpu.wgmma(
                    acc_ref,
                    plgpu.transpose_ref(w_smem, (1, 0)),
                    plgpu.transpose_ref(x_smem, (1, 0)),
                )

            col = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA)
            acc = jnp.where(
                col < jnp.where(live, tile_n, 0), pl.run_state(mma)(plgpu.ACC.init(acc)), acc
            )
            ends = live & ((lax.rem(g, k_steps) == k_steps - 1) | (i == count - 1))

            @pl.when(ends)
            def _():
                o_smem[...] = acc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_ref.at[p, seg])
                plgpu.wait_smem_to_gmem(0)

            acc = jnp.where(col < jnp.where(ends, 0, tile_n), acc, jnp.zeros_like(acc))
            return acc, seg + ends.astype(jnp.int32)

        acc0 = plgpu.layout_cast(jnp.zeros((tile_n, rows), jnp.float32), plgpu.Layout.WGMMA)
        plgpu.emit_pipeline(
            step,
            grid=(max_count,),
            in_specs=[
                plgpu.BlockSpec(
                    (rows, tile_k), lambda i: (0, lax.rem(it(i), k_steps)), transforms=TRANSFORMS
                ),
                plgpu.BlockSpec(
                    (tile_k, tile_n),
                    lambda i: (lax.rem(it(i), k_steps), it(i) // k_steps),
                    transforms=TRANSFORMS,
                ),
            ],
            max_concurrent_steps=stages,
            init_carry=(acc0, jnp.int32(0)),
        )(x_ref, w_ref)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_programs, segments, tile_n, rows), jnp.float32),
        grid=(num_programs,),
        grid_names=("program",),
        scratch_types=(plgpu.SMEM((tile_n, rows), jnp.float32),),
    )(x, w)


def fix_up_swap(partials, k, n, num_programs, *, tile_n, tile_k) -> np.ndarray:
    """The product [rows, n] from `stream_k_swap_ab`'s partials (host, for the check)."""
    k_steps, total = k // tile_k, (n // tile_n) * (k // tile_k)
    rows = partials.shape[-1]
    out = np.zeros((rows, n), np.float32)
    for p in range(num_programs):
        first = p * total // num_programs
        count = (p + 1) * total // num_programs - first
        tiles = sorted({g // k_steps for g in range(first, first + count)})
        for seg, t in enumerate(tiles):
            out[:, t * tile_n : (t + 1) * tile_n] += partials[p, seg].T
    return out


def fix_up(partials, k: int, n: int, num_programs: int) -> np.ndarray:
    """The product from the partials (host): each program's segments added to their tiles."""
    k_steps = k // TILE_K
    out = np.zeros((ROWS, n), np.float32)
    for p, (first, count) in enumerate(shares(k, n, num_programs)):
        tiles = sorted({g // k_steps for g in range(first, first + count)})
        assert len(tiles) <= 2, "a share spans more than two tiles"
        for seg, t in enumerate(tiles):
            out[:, t * TILE_N : (t + 1) * TILE_N] += partials[p, seg]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument(
        "--swap", nargs="+", default=["64,64,8", "64,128,4"], help="tile_n,tile_k,stages"
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[4], help="the M=64 walk")
    args = parser.parse_args()
    num_programs = device_num_sms()
    cases = []
    for shape in args.shapes:
        k, n = SHAPES[shape]
        keys = jax.random.split(jax.random.key(0), LAYERS)
        ws = [0.02 * jax.random.normal(kk, (k, n), jnp.bfloat16) for kk in keys]
        nbytes = k * n * 2
        for rows in args.rows:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            variants = [("xla", jnp.matmul, None)]
            if rows == ROWS:
                variants += [
                    (
                        f"stream-k stages={s}",
                        functools.partial(stream_k_matmul, num_programs=num_programs, stages=s),
                        lambda got, k=k, n=n: fix_up(got, k, n, num_programs),
                    )
                    for s in args.stages
                ]
            for spec in args.swap:
                tn, tk, s = map(int, spec.split(","))
                variants.append(
                    (
                        f"swap-ab tile_n={tn} tile_k={tk} stages={s}",
                        functools.partial(
                            stream_k_swap_ab,
                            num_programs=num_programs,
                            tile_n=tn,
                            tile_k=tk,
                            stages=s,
                        ),
                        lambda got, k=k, n=n, tn=tn, tk=tk: fix_up_swap(
                            got, k, n, num_programs, tile_n=tn, tile_k=tk
                        ),
                    )
                )
            for name, fn, fix in variants:
                case = dict(shape=shape, impl=name, rows=rows)
                try:
                    layered = jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws])
                    case["us"] = kernel_time_ms(layered, x, ws) * 1e3 / LAYERS
                    case["tb_s"] = nbytes / case["us"] / 1e6
                    if fix is not None:
                        got = fix(np.asarray(fn(x, ws[0])))[:rows]
                        want = np.asarray(jnp.dot(x, ws[0], preferred_element_type=jnp.float32))
                        case["max_err"] = float(np.max(np.abs(got - want)))
                        case["max_ref"] = float(np.max(np.abs(want)))
                except Exception as e:  # noqa: BLE001 - a probe records and goes on
                    case["error"] = error_text(e)
                print(json.dumps(case), flush=True)
                cases.append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="stream_k", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
