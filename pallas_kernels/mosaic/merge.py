"""The split-KV merge of the Mosaic decode kernel as one Mosaic GPU kernel.

XLA compiles the merge (`pallas_kernels.common.merge_splits`) into two kernels: the weights
`exp(lse - max)` once, then the weighted sum, since it does not recompute an exponential in
every output element. In a B=1 decode step they take ~2.5 us a layer, most of it the fixed
cost of a kernel (benchmarks/NOTES.md, sessions 16, 31 and 34). This kernel does the merge in
one launch and stays off Triton, as the Mosaic GPU path must.

The merge is a few loads per thread, so it is written per thread (`plgpu.inline_mgpu`) rather
than in Mosaic GPU's warpgroup layouts. Each program (one warpgroup) merges `rows` output rows
of one leading index: each of its 128 threads takes 4 consecutive elements of those rows,
loads their partials of every split (one vector load each) and each split's LSE of the row,
and writes 4 merged elements (and, at column 0, the row's LSE). All loads are issued before
any result is needed, so the merge costs about one L2 round trip. (Session 29 measured the
same per-thread merge inside the decode kernel; this is its standalone form.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.common import launch

_THREADS = 128  # one warpgroup
_VEC = 4  # float32 elements per load
# At most this many vector loads of partials per thread, all in flight together (four
# registers each): past it, the merge stays in XLA.
MAX_LOADS_PER_THREAD = 64


def rows_per_program(num_rows: int, head_dim: int) -> int:
    """The most output rows (a divisor of `num_rows`) whose elements one warpgroup covers in
    one vector load per thread and split."""
    fits = max(1, _THREADS * _VEC // head_dim)
    return max(r for r in range(1, min(fits, num_rows) + 1) if num_rows % r == 0)


def takes(num_splits: int, num_rows: int, head_dim: int) -> bool:
    """Whether `merge_splits` runs this kernel for partials [X, num_splits, num_rows, D]: D a
    multiple of the vector width, and each thread's loads at most `MAX_LOADS_PER_THREAD`."""
    if head_dim % _VEC or num_splits < 1 or num_rows < 1:
        return False
    chunks = rows_per_program(num_rows, head_dim) * head_dim // _VEC
    return num_splits * math.ceil(chunks / _THREADS) <= MAX_LOADS_PER_THREAD


def merge_splits(outs: jax.Array, lses: jax.Array, *, out_dtype) -> tuple[jax.Array, jax.Array]:
    """`pallas_kernels.common.merge_splits` in one Mosaic GPU kernel (a GPU only).

    Args:
      outs: f32[X, splits, Y, D] normalized partial outputs (`takes(splits, Y, D)`).
      lses: f32[X, splits, Y] their natural-log LSEs; -inf marks an empty partial (its output
        row is ignored, even if NaN).
      out_dtype: dtype of the merged output.

    Returns:
      `out` [X, Y, D] in `out_dtype` and `lse` f32[X, Y]; rows whose partials are all empty
      give 0 and -inf.
    """
    num_x, num_splits, num_rows, head_dim = outs.shape
    if lses.shape != (num_x, num_splits, num_rows):
        raise ValueError(f"lses must be {(num_x, num_splits, num_rows)} for outs {outs.shape}")
    if outs.dtype != jnp.float32 or lses.dtype != jnp.float32:
        raise TypeError(f"outs and lses must be float32; got {outs.dtype}, {lses.dtype}")
    if not takes(num_splits, num_rows, head_dim):
        raise ValueError(
            f"the Mosaic merge takes D a multiple of {_VEC} and at most "
            f"{MAX_LOADS_PER_THREAD} loads a thread; got outs {outs.shape}"
        )
    rows = rows_per_program(num_rows, head_dim)
    out_types = (
        jax.ShapeDtypeStruct((num_x, num_rows, head_dim), out_dtype),
        jax.ShapeDtypeStruct((num_x, num_rows), jnp.float32),
    )

    def body(outs_ref, lses_ref, out_ref, lse_ref):
        x, block = lax.axis_index("x"), lax.axis_index("rows")
        heads = pl.ds(block * rows, rows)
        _merge_rows(
            outs_ref.at[x, :, heads],
            lses_ref.at[x, :, heads],
            out_ref.at[x, heads],
            lse_ref.at[x, heads],
        )

    return launch(
        body,
        out_types,
        (outs, lses),
        grid=(num_x, num_rows // rows),
        grid_names=("x", "rows"),
    )


def _merge_rows(parts, part_lses, out, lse) -> None:
    """Merge `parts` f32[splits, rows, D] (LSEs `part_lses` f32[splits, rows]) into `out`
    [rows, D] and `lse` f32[rows], by one warpgroup (GMEM refs)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 4)
    def merge(ctx, parts, part_lses, out, lse):
        del ctx
        num_splits, num_rows, head_dim = ir.MemRefType(parts.type).shape
        out_type = ir.MemRefType(out.type).element_type
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        vec_f32 = ir.VectorType.get([_VEC], f32)
        vec_out = ir.VectorType.get([_VEC], out_type)
        chunks_per_row = head_dim // _VEC
        num_chunks = num_rows * chunks_per_row
        tid = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(_THREADS, i32))
        for i in range(math.ceil(num_chunks / _THREADS)):
            chunk = arith.addi(tid, mgpu_utils.c(i * _THREADS, i32))

            def merge_chunk(chunk=chunk):
                row = arith.index_cast(index, arith.divui(chunk, mgpu_utils.c(chunks_per_row, i32)))
                col_chunk = arith.remui(chunk, mgpu_utils.c(chunks_per_row, i32))
                col = arith.index_cast(index, arith.muli(col_chunk, mgpu_utils.c(_VEC, i32)))
                splits = [mgpu_utils.c(s, index) for s in range(num_splits)]
                lses = [memref.load(part_lses, [s, row]) for s in splits]
                values = [vector.load(vec_f32, parts, [s, row, col]) for s in splits]
                merged, row_lse = merge_values(lses, values)
                if out_type != f32:
                    merged = arith.truncf(vec_out, merged)
                vector.store(merged, out, [row, col])
                first = arith.cmpi(arith.CmpIPredicate.eq, col_chunk, mgpu_utils.c(0, i32))
                with mgpu_utils.when(first):
                    memref.store(row_lse, lse, [row])

            if (i + 1) * _THREADS <= num_chunks:
                merge_chunk()
            else:
                inside = arith.cmpi(arith.CmpIPredicate.ult, chunk, mgpu_utils.c(num_chunks, i32))
                with mgpu_utils.when(inside):
                    merge_chunk()

    merge(parts, part_lses, out, lse)


def merge_values(lses, values):
    """Per-thread code: the merge of one run of elements over the splits, from each split's
    LSE (f32 scalars) and its run of normalized outputs (f32 vectors); returns the merged run
    (f32) and the row's LSE. An empty split (LSE -inf) weighs exp(-inf) = 0, and its output,
    even NaN, is selected away rather than multiplied by 0; with every split empty the run is
    0 and the LSE -inf."""
    f32 = ir.F32Type.get()
    vec_f32 = values[0].type
    width = ir.VectorType(vec_f32).shape[0]
    zero, one = mgpu_utils.c(0.0, f32), mgpu_utils.c(1.0, f32)
    minus_inf = mgpu_utils.c(float("-inf"), f32)
    m = lses[0]
    for x in lses[1:]:
        m = arith.maximumf(m, x)
    empty = arith.cmpf(arith.CmpFPredicate.OEQ, m, minus_inf)
    m_safe = arith.select(empty, zero, m)
    acc, total = None, zero
    for x, v in zip(lses, values, strict=True):
        w = mlir_math.exp(arith.subf(x, m_safe))
        total = arith.addf(total, w)
        visible = arith.cmpf(arith.CmpFPredicate.OGT, w, zero)
        term = arith.mulf(vector.broadcast(vec_f32, w), v)
        term = arith.select(
            vector.broadcast(ir.VectorType.get([width], ir.IntegerType.get_signless(1)), visible),
            term,
            vector.broadcast(vec_f32, zero),
        )
        acc = term if acc is None else arith.addf(acc, term)
    no_key = arith.cmpf(arith.CmpFPredicate.OEQ, total, zero)
    scale = arith.divf(one, arith.select(no_key, one, total))
    merged = arith.mulf(acc, vector.broadcast(vec_f32, scale))
    row_lse = arith.addf(m_safe, mlir_math.log(arith.select(no_key, one, total)))
    return merged, arith.select(no_key, minus_inf, row_lse)
