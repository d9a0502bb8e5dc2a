"""A decoder's residual add and the RMSNorm after it as one Mosaic GPU kernel:
`pallas_kernels.triton.add_rms_norm` off the Triton lowering, which JAX has deprecated.

One program per row. Its threads take the row in runs of 4 columns, thread t the runs t,
t + threads, ... Every load (the row of x, each part of h, the scale) is issued before the
first store, and the norm's sum of squares is a butterfly within each warp, then a sum of the
warps' totals through shared memory. The code is per thread (`plgpu.inline_mgpu`), as
`pallas_kernels.mosaic.rope_append` is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, memref, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.common import launch

_RUN = 4  # columns a thread loads at once: 16 bytes of float32 partial sums
# Warpgroups a program: more threads issue a row's loads sooner (one SM reads the whole row,
# 8 float32 parts of it in a decode step's o and down projections): 2.19 us a call in the `1b`
# decode step at B=1 against 2.34 with one (benchmarks/NOTES.md, run 189).
NUM_WARPGROUPS = 4


def supported(hidden: int) -> bool:
    """Whether the kernel takes rows of `hidden` columns: whole runs of 4."""
    return hidden % _RUN == 0


def add_rms_norm(
    x: jax.Array, h: jax.Array, scale: jax.Array, *, eps: float
) -> tuple[jax.Array, jax.Array]:
    """`jaxpaged.layers.add_rms_norm` in one Mosaic GPU kernel (a GPU only); arguments and
    results as `pallas_kernels.triton.add_rms_norm.add_rms_norm` (checked by the caller): x
    [T, hidden], h [T, hidden] in x's dtype or float32 partial sums [S, T, hidden], scale
    [hidden]; returns (x + h, its RMSNorm), both [T, hidden] in x's dtype."""
    num_rows, hidden = x.shape
    if not supported(hidden):
        raise ValueError(f"the Mosaic add_rms_norm takes a hidden size of whole 4s; got {hidden}")
    parts = h if h.ndim == 3 else h[None]
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    threads = 128 * NUM_WARPGROUPS

    def body(x_ref, parts_ref, scale_ref, sum_ref, normed_ref, warp_sums):
        row = lax.axis_index("row")
        _row(
            x_ref.at[row],
            parts_ref.at[:, row],
            scale_ref,
            sum_ref.at[row],
            normed_ref.at[row],
            warp_sums,
            eps=eps,
            partial=h.ndim == 3,
            threads=threads,
        )

    return launch(
        body,
        (out_type, out_type),
        (x, parts, scale),
        grid=(num_rows,),
        grid_names=("row",),
        num_threads=NUM_WARPGROUPS,
        thread_name="wg",
        scratch_types=(plgpu.SMEM((threads // 32,), jnp.float32),),
        kernel_name="add_rms_norm",
    )


def _row(x, parts, scale, sum_out, normed_out, warp_sums, *, eps, partial, threads) -> None:
    """One program's row: `x` [hidden], `parts` [S, hidden], `scale` [hidden] in, `sum_out`
    and `normed_out` [hidden] out (GMEM refs), `warp_sums` f32[warps] (SMEM)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 6)
    def row(ctx, x, parts, scale, sum_out, normed_out, warp_sums):
        del ctx
        num_parts, hidden = ir.MemRefType(parts.type).shape
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        dtype = ir.MemRefType(x.type).element_type
        vec = lambda t: ir.VectorType.get([_RUN], t)  # noqa: E731

        def c32(v):
            return mgpu_utils.c(v, i32)

        def as_f32(v, t):
            return v if t == f32 else arith.extf(vec(f32), v)

        def load(ref, indices):
            t = ir.MemRefType(ref.type).element_type
            return as_f32(vector.load(vec(t), ref, indices), t)

        def rounded(v):
            """v rounded to x's dtype, as float32."""
            return v if dtype == f32 else arith.extf(vec(f32), arith.truncf(vec(dtype), v))

        def to_dtype(v):
            return v if dtype == f32 else arith.truncf(vec(dtype), v)

        tid = mgpu_utils.thread_idx()
        # Runs past the row's end load the last run again; they add nothing and store nothing.
        runs, loaded = [], []
        for k in range(-(-hidden // (_RUN * threads))):
            col = arith.muli(arith.addi(tid, c32(k * threads)), c32(_RUN))
            valid = arith.cmpi(arith.CmpIPredicate.ult, col, c32(hidden))
            col = arith.index_cast(index, arith.minui(col, c32(hidden - _RUN)))
            terms = [load(parts, [mgpu_utils.c(s, index), col]) for s in range(num_parts)]
            runs.append((valid, col))
            loaded.append((load(x, [col]), terms, load(scale, [col])))
        totals, squares = [], None
        for (valid, _), (x_run, terms, _) in zip(runs, loaded, strict=True):
            h_run = terms[0]
            for term in terms[1:]:
                h_run = arith.addf(h_run, term)
            if partial:  # the projection's output, rounded as it would be
                h_run = rounded(h_run)
            total = rounded(arith.addf(x_run, h_run))
            totals.append(total)
            square = arith.mulf(total, total)
            square = arith.select(valid, square, vector.broadcast(vec(f32), mgpu_utils.c(0.0, f32)))
            squares = square if squares is None else arith.addf(squares, square)
        # RMSNorm as flax's `nnx.RMSNorm` computes it: float32 statistics of the rounded sum,
        # the row times (rsqrt * scale), rounded to the dtype.
        inv = inverse_rms(squares, warp_sums, tid, hidden=hidden, eps=eps, barrier=gpu.barrier)
        r = vector.broadcast(vec(f32), inv)
        for (valid, col), (_, _, s_run), total in zip(runs, loaded, totals, strict=True):
            with mgpu_utils.when(valid):
                vector.store(to_dtype(total), sum_out, [col])
                vector.store(to_dtype(arith.mulf(total, arith.mulf(r, s_run))), normed_out, [col])

    row(x, parts, scale, sum_out, normed_out, warp_sums)


def inverse_rms(squares, warp_sums, tid, *, hidden: int, eps: float, barrier):
    """Per-thread code (inside `plgpu.inline_mgpu`): `rsqrt(mean(row ** 2) + eps)` of a row
    spread over a program's threads. Each thread holds `squares`, a vector of its columns'
    squares (zero past the row's end); thread `tid`'s lanes are summed, then a butterfly within
    each warp, then the warps' totals through `warp_sums` (f32[warps], shared memory) after
    `barrier()`. Returns the float32 scalar."""
    i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
    lane_total = None
    for e in range(ir.VectorType(squares.type).shape[0]):
        item = vector.extract(
            squares, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e])
        )
        lane_total = item if lane_total is None else arith.addf(lane_total, item)
    warp_total = mgpu_utils.warp_tree_reduce(lane_total, arith.addf, 32)
    warp = arith.index_cast(index, arith.divui(tid, mgpu_utils.c(32, i32)))
    lane = arith.remui(tid, mgpu_utils.c(32, i32))
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, lane, mgpu_utils.c(0, i32))):
        memref.store(warp_total, warp_sums, [warp])
    barrier()
    num_warps = ir.MemRefType(warp_sums.type).shape[0]
    sum_sq = memref.load(warp_sums, [mgpu_utils.c(0, index)])
    for w in range(1, num_warps):
        sum_sq = arith.addf(sum_sq, memref.load(warp_sums, [mgpu_utils.c(w, index)]))
    mean = arith.divf(sum_sq, mgpu_utils.c(float(hidden), f32))
    return mlir_math.rsqrt(arith.addf(mean, mgpu_utils.c(eps, f32)))
