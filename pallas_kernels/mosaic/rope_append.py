"""The attention layer's work between its QKV projection and attention (qk-norm, RoPE and the
K/V append to the pages) as one Mosaic GPU kernel: `pallas_kernels.triton.rope_append` off the
Triton lowering, which JAX has deprecated.

One program (one warpgroup) per (token, KV head) takes the G + 2 rows of that head's
projection (its G query heads, its k, its v): warp w the rows w, w + 4, ... Each lane holds
the same D / 64 consecutive elements of both halves of a row, so that RoPE's rotation (element
i with element i + D / 2) stays in the lane and the norm's sum over D is one butterfly
reduction across the warp. Every load is issued before the first store (the pages are
written in place and may alias nothing the kernel reads, but a load after a store still waits
for it). The code is per thread (`plgpu.inline_mgpu`), as `pallas_kernels.mosaic.merge` is.

`plgpu.kernel` takes no `input_output_aliases` in jax 0.11.2: the pages go in as refs
(`jax.new_ref`), which lower to a custom call whose output aliases the pool, so XLA updates a
donated pool in place (`probes/page_alias.py`: no copy of a 256 MB pool, runs 183-184).
"""

from __future__ import annotations

import math

import jax
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.common import launch

_THREADS = 128  # one warpgroup
_WARPS = _THREADS // 32


def supported(head_dim: int) -> bool:
    """Whether the kernel takes `head_dim`: each of a warp's 32 lanes holds D / 64 elements of
    each half of a row, one vector load of 1, 2 or 4 elements."""
    return head_dim in (64, 128, 256)


def rope_append(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    q_scale: jax.Array | None,
    k_scale: jax.Array | None,
    k_pages: jax.Array,
    v_pages: jax.Array,
    slots: jax.Array,
    *,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`jaxpaged.layers.rope_append` in one Mosaic GPU kernel (a GPU only); arguments and
    results as `pallas_kernels.triton.rope_append.rope_append` (checked by the caller): qkv
    [T, Hkv, G + 2, D] in the pages' dtype or float32 partial sums [S, T, Hkv, G + 2, D],
    cos and sin f32[T, D / 2], slots i32[T] (-1 or a slot outside the pool writes nothing)."""
    partial = qkv.ndim == 5
    parts = qkv if partial else qkv[None]
    num_tokens, num_kv_heads, group2, head_dim = parts.shape[1:]
    if not supported(head_dim):
        raise ValueError(f"the Mosaic rope_append takes D of 64, 128 or 256; got {head_dim}")
    group = group2 - 2
    dtype = k_pages.dtype
    q_type = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), dtype)
    scales = () if q_scale is None else (q_scale, k_scale)
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)

    def body(slots_ref, parts_ref, cos_ref, sin_ref, *refs):
        *scale_refs, k_pages_ref, v_pages_ref, q_ref = refs
        token, head = lax.axis_index("token"), lax.axis_index("kv_head")
        _rope_rows(
            parts_ref.at[:, token, head],
            cos_ref.at[token],
            sin_ref.at[token],
            *scale_refs,
            slots_ref.at[pl.ds(token, 1)],
            k_pages_ref.at[:, :, head],
            v_pages_ref.at[:, :, head],
            q_ref.at[token, pl.ds(head * group, group)],
            eps=eps,
        )

    (q,) = launch(
        body,
        (q_type,),
        (slots, parts, cos, sin, *scales, k_ref, v_ref),
        grid=(num_tokens, num_kv_heads),
        grid_names=("token", "kv_head"),
        kernel_name="rope_append",  # in profiles; the other Mosaic kernels are `body`
    )
    return q, k_ref[...], v_ref[...]


def _rope_rows(parts, cos, sin, *refs, eps: float) -> None:
    """One program's rows: `parts` f32 or dtype [S, G + 2, D], `cos`/`sin` f32[D / 2], the
    optional q and k scales [D], `slot` i32[1], the head's pages `k_pages`/`v_pages` [P,
    page_size, D] and its queries' output `q` [G, D] (GMEM refs)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (3 + len(refs)))
    def rows(ctx, parts, cos, sin, *refs):
        del ctx
        *scales, slot_ref, k_pages, v_pages, q_out = refs

        def store_q(row, lo, hi, rot_lo, rot_hi):
            vector.store(rot_lo, q_out, [row, lo])
            vector.store(rot_hi, q_out, [row, hi])

        emit_rope_rows(
            parts,
            cos,
            sin,
            scales or None,
            lambda: memref.load(slot_ref, [mgpu_utils.c(0, ir.IndexType.get())]),
            k_pages,
            v_pages,
            eps=eps,
            store_q=store_q,
        )

    rows(parts, cos, sin, *refs)


def emit_rope_rows(
    parts, cos, sin, scales, slot_of, k_pages, v_pages, *, eps: float, store_q, store_new=None
) -> None:
    """Per-thread Mosaic GPU code (inside `plgpu.inline_mgpu`, one warpgroup) for the G + 2
    rows of one (token, KV head): sum and round the projection's parts, qk-norm, rotate, store
    the G query rows through `store_q` and write k and v into the pages at `slot`.

    Args (MLIR memrefs): `parts` [S, G + 2, D] float32 or the pages' dtype; `cos`, `sin`
      f32[D / 2]; `scales` None or the (q, k) RMSNorm scales [D]; `k_pages`, `v_pages` [P,
      page_size, D]; and `slot_of()`, which emits the slot's i32 value after the loads (a slot
      outside the pool writes nothing).
      `store_q(row, lo, hi, rot_lo, rot_hi)` stores query row `row` (an index), whose lane
      holds the D / 64 elements at columns `lo` and `hi` (indices, `hi = lo + D / 2`) as
      vectors in the pages' dtype; `store_new(which, lo, hi, x_lo, x_hi)`, if given, gets the
      new k (`which` 0) and v (1) rows alike, whether or not the slot is in the pool.
    """
    num_parts, group2, head_dim = ir.MemRefType(parts.type).shape
    num_pages, page_size = ir.MemRefType(k_pages.type).shape[:2]
    group = group2 - 2
    per_lane, half = head_dim // 64, head_dim // 2
    i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
    dtype = ir.MemRefType(k_pages.type).element_type
    part_type = ir.MemRefType(parts.type).element_type
    vec = lambda t: ir.VectorType.get([per_lane], t)  # noqa: E731

    def c32(x):
        return mgpu_utils.c(x, i32)

    def idx(x):
        return arith.index_cast(index, x)

    def as_f32(x, t):
        return x if t == f32 else arith.extf(vec(f32), x)

    def rounded(x):
        """x rounded to the pages' dtype, as float32."""
        return x if dtype == f32 else arith.extf(vec(f32), arith.truncf(vec(dtype), x))

    def to_dtype(x):
        return x if dtype == f32 else arith.truncf(vec(dtype), x)

    def load(ref, indices, t):
        return as_f32(vector.load(vec(t), ref, indices), t)

    tid = arith.remui(mgpu_utils.thread_idx(), c32(_THREADS))
    lane, warp = arith.remui(tid, c32(32)), arith.divui(tid, c32(32))
    lo = idx(arith.muli(lane, c32(per_lane)))
    hi = arith.addi(lo, mgpu_utils.c(half, index))
    # Loads: every row this warp takes (rows past the last read the last row again: their
    # results are never stored), the angles and the scales.
    rows_per_warp = math.ceil(group2 / _WARPS)
    row_ids, values = [], []
    for i in range(rows_per_warp):
        row = arith.addi(warp, c32(i * _WARPS))
        row_ids.append(row)
        clamped = idx(arith.minui(row, c32(group2 - 1)))
        halves = []
        for col in (lo, hi):
            terms = [
                load(parts, [mgpu_utils.c(s, index), clamped, col], part_type)
                for s in range(num_parts)
            ]
            total = terms[0]
            for term in terms[1:]:
                total = arith.addf(total, term)
            halves.append(rounded(total))  # the projection's output, rounded as it is
        values.append(halves)
    cos_lo, sin_lo = (load(r, [lo], f32) for r in (cos, sin))
    if scales is not None:
        scale_type = ir.MemRefType(scales[0].type).element_type
        scales = [[load(s, [col], scale_type) for col in (lo, hi)] for s in scales]
    slot = slot_of()
    num_slots = num_pages * page_size
    ok = arith.andi(
        arith.cmpi(arith.CmpIPredicate.sge, slot, c32(0)),
        arith.cmpi(arith.CmpIPredicate.slt, slot, c32(num_slots)),
    )
    slot = arith.maxsi(arith.minsi(slot, c32(num_slots - 1)), c32(0))
    page = idx(arith.divui(slot, c32(page_size)))
    offset = idx(arith.remui(slot, c32(page_size)))

    def lane_sum(x):
        total = None
        for e in range(per_lane):
            item = vector.extract(
                x, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e])
            )
            total = item if total is None else arith.addf(total, item)
        return total

    for row, (x_lo, x_hi) in zip(row_ids, values, strict=True):
        is_q = arith.cmpi(arith.CmpIPredicate.ult, row, c32(group))
        is_k = arith.cmpi(arith.CmpIPredicate.eq, row, c32(group))
        is_v = arith.cmpi(arith.CmpIPredicate.eq, row, c32(group + 1))
        y_lo, y_hi = x_lo, x_hi
        if scales is not None:
            # RMSNorm as flax's `nnx.RMSNorm` computes it: float32 statistics, the row
            # times (rsqrt * scale), rounded to the dtype. The whole warp takes part in
            # the butterfly, whatever its row.
            squares = arith.addf(lane_sum(arith.mulf(x_lo, x_lo)), lane_sum(arith.mulf(x_hi, x_hi)))
            mean = arith.divf(
                mgpu_utils.warp_tree_reduce(squares, arith.addf, 32),
                mgpu_utils.c(float(head_dim), f32),
            )
            r = mlir_math.rsqrt(arith.addf(mean, mgpu_utils.c(eps, f32)))
            r = vector.broadcast(vec(f32), r)
            s_lo = arith.select(is_q, scales[0][0], scales[1][0])
            s_hi = arith.select(is_q, scales[0][1], scales[1][1])
            y_lo = rounded(arith.mulf(x_lo, arith.mulf(r, s_lo)))
            y_hi = rounded(arith.mulf(x_hi, arith.mulf(r, s_hi)))
        # RoPE: (x1 cos - x2 sin, x2 cos + x1 sin), rounded to the dtype.
        rot_lo = to_dtype(arith.subf(arith.mulf(y_lo, cos_lo), arith.mulf(y_hi, sin_lo)))
        rot_hi = to_dtype(arith.addf(arith.mulf(y_hi, cos_lo), arith.mulf(y_lo, sin_lo)))
        v_lo, v_hi = to_dtype(x_lo), to_dtype(x_hi)
        with mgpu_utils.when(is_q):
            store_q(idx(row), lo, hi, rot_lo, rot_hi)
        with mgpu_utils.when(arith.andi(is_k, ok)):
            vector.store(rot_lo, k_pages, [page, offset, lo])
            vector.store(rot_hi, k_pages, [page, offset, hi])
        with mgpu_utils.when(arith.andi(is_v, ok)):
            vector.store(v_lo, v_pages, [page, offset, lo])
            vector.store(v_hi, v_pages, [page, offset, hi])
        if store_new is not None:
            with mgpu_utils.when(is_k):
                store_new(0, lo, hi, rot_lo, rot_hi)
            with mgpu_utils.when(is_v):
                store_new(1, lo, hi, v_lo, v_hi)
