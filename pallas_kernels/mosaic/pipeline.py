"""The K/V page pipeline that both Mosaic GPU kernels run inside their bodies.

A copy warpgroup brings K and V into `num_stages` shared-memory stages of `block_kv` keys,
one TMA copy per page (a `[page_size, D]` box of the strided view `k_pages[page, :, kv_head,
:]`), and compute releases each stage when its product is done. Slots past `kv_len` (the tail
of the last page, pages named by garbage table entries) and keys outside a sliding window may
be loaded, even as NaN; their logits are masked to -inf, and their V rows are zeroed before
the P V product, because P is exactly 0 there but 0 * NaN is NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src.lib.mlir.dialects import arith
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import visible

SWIZZLE = 128  # bytes; every supported D is a multiple of the 64 16-bit elements this spans.
# The layout of the Q tiles and K/V stages that `wgmma` reads: 8-row tiles, 128-byte swizzle.
TILED = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


def tiled_indices(row, col) -> list:
    """Per-thread code's indices (MLIR index values) of element (`row`, `col`) of a 16-bit
    `TILED` shared-memory ref, which `plgpu.inline_mgpu` hands over as `[rows / 8, D / 64, 8,
    64]` with the swizzle left to the code: the 16-byte chunk of each 128-byte row is XORed
    with the row's place in its 8-row tile. A run of up to 8 elements that starts at a
    multiple of its length stays inside one chunk."""

    def c(x):
        return mgpu_utils.c(x, row.type)

    tile_cols = SWIZZLE // 2
    in_tile = arith.remui(row, c(8))
    col_in_tile = arith.remui(col, c(tile_cols))
    chunk = arith.xori(arith.divui(col_in_tile, c(8)), in_tile)
    return [
        arith.divui(row, c(8)),
        arith.divui(col, c(tile_cols)),
        in_tile,
        arith.addi(arith.muli(chunk, c(8)), arith.remui(col_in_tile, c(8))),
    ]


def last_page_of(kv_len, page_size: int):
    """The index in its table row of a sequence's last page (0 for an empty sequence)."""
    return (jnp.maximum(kv_len, 1) - 1) // page_size


def copy_step(kv, table_ref, *, seq, block, last_page, kv_head, slot, step) -> None:
    """One step of the copy warpgroup: the pages of keys `[block * block_kv, (block + 1) *
    block_kv)` of sequence `seq` into stage `slot`, K first (compute releases K's stage before
    V's: after Q K^T, not P V).

    `kv` is `((k_pages, k_smem, k_ready, k_free), (v_pages, v_smem, v_ready, v_free))`: the
    pools [P, page_size, Hkv, D], the stages [stages, block_kv, D], and per stage the barriers
    its copies arrive on (one arrival per page) and compute releases it on. `step` counts the
    copy warpgroup's steps: from `stages` on, a stage is refilled once compute releases it.
    Table entries past `last_page` are garbage: the last page is reloaded instead (an L2 hit;
    its rows are masked like every row past kv_len). Every page id is clamped into the pool.
    """
    pool, stages = kv[0][0], kv[0][1]
    num_pages, page_size = pool.shape[:2]
    pages_per_step = stages.shape[1] // page_size
    first_page = block * pages_per_step
    pages = [
        jnp.clip(table_ref[seq, jnp.minimum(first_page + j, last_page)], 0, num_pages - 1)
        for j in range(pages_per_step)
    ]
    for src, dst, ready, free in kv:

        @pl.when(step >= dst.shape[0])
        def _wait_free(free=free):
            plgpu.barrier_wait(free.at[slot])

        for j, page in enumerate(pages):
            plgpu.copy_gmem_to_smem(
                src.at[page, :, kv_head, :],
                dst.at[slot, pl.ds(j * page_size, page_size)],
                ready.at[slot],
            )


def zero_invisible_v(v_tile, start, kv_len, sliding_window: int | None) -> None:
    """Zero the rows of the V stage `v_tile` [block_kv, D] (keys `start ...`) that the last
    token of the sequence (at `kv_len - 1`) does not see: keys past `kv_len` and, with a
    window, before it. Only the at most two steps of a sequence that hold such rows pay for it.
    The earlier tokens of a prefill block see no key past `kv_len` either; the keys its causal
    mask hides are real keys (not garbage), so a prefill passes no window here."""
    has_invisible = start + v_tile.shape[0] > kv_len
    if sliding_window is not None:
        has_invisible |= start <= kv_len - 1 - sliding_window

    @pl.when(has_invisible)
    def _zero_invisible_v():
        key_of_row = start + plgpu.broadcasted_iota(
            jnp.int32, v_tile.shape, 0, layout=plgpu.Layout.WGMMA
        )
        row_ok = visible(
            kv_len - 1, key_of_row, kv_len, causal=False, sliding_window=sliding_window
        )
        v_tile[...] = jnp.where(row_ok, v_tile[...], 0)
        plgpu.commit_smem()
