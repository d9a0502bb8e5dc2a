"""The block plan of the ragged prefill kernels, computed in XLA from the batch metadata.

Both prefill kernels (`pallas_kernels.triton.ragged_prefill`, `pallas_kernels.mosaic.
ragged_prefill`) cut every sequence into blocks of consecutive tokens; the plan says which
sequence and tokens each grid step takes and which key tiles it visits. Its size depends only
on the padded sizes of the batch, so a new batch of the same sizes never compiles again.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Block(NamedTuple):
    """One column of the plan (`plan_blocks`, whose columns are the grid's q blocks), as a
    kernel reads it (`read_block`); its fields are the plan's rows, in order."""

    seq: jax.Array
    first_token: jax.Array
    num_tokens: jax.Array
    first_pos: jax.Array
    kv_len: jax.Array
    tile_lo: jax.Array
    full_lo: jax.Array
    full_hi: jax.Array
    tile_hi: jax.Array


def read_block(plan_ref, block) -> Block:
    """The plan's column `block`, read inside a kernel (every row, in order)."""
    return Block(*(plan_ref[row, block] for row in range(len(Block._fields))))


def num_blocks(num_tokens: int, num_seq_slots: int, tokens: int, align: int = 1) -> int:
    """Upper bound on the q blocks of any batch of these padded sizes: the S sequences and the
    padding tokens (one more pseudo-sequence) each round up to whole blocks, after moving
    their start down to a multiple of `align` (see `plan_blocks`)."""
    spill = tokens - 1 + align - 1
    return max(1, (num_tokens + (num_seq_slots + 1) * spill) // tokens)


def plan_blocks(
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    num_tokens: int,
    tokens: int,
    block_kv: int,
    causal: bool,
    sliding_window: int | None,
    skip_up_to: int = 0,
    align: int = 1,
) -> jax.Array:
    """The work of every grid step, in XLA: i32[9, num_blocks(...)].

    `cu_q_lens` i32[S+1] and `kv_lens` i32[S] must be sanitized (`sanitize_metadata`). The
    padding tokens `[cu_q_lens[S], T)` form one more sequence with no keys, so that the kernel
    itself writes their 0 / -inf. Sequences of at most `skip_up_to` tokens are left to the
    short-sequence launch (`plan_short_sequences`). Column i says which sequence and tokens
    step i takes, the position of its first token, and its key tiles: `[tile_lo, tile_hi)`
    holds every key some row sees, `[full_lo, full_hi)` the tiles every row sees whole (no mask
    needed). Steps past the last block get no tokens and no tiles.

    With `align` > 1 a sequence's blocks are laid out from its first token rounded down to a
    multiple of `align`: block rows start on multiples of `align` (the Mosaic GPU kernel's Q
    copies need it), and a first block's leading rows belong to the previous sequence (a
    kernel recovers them as `first_token % align` and ignores them).

    Blocks run in reverse order, the last block of the last sequence first: under a causal
    mask a sequence's last blocks see the most keys, so the GPU's last wave holds short blocks.
    """
    num_seq_slots = kv_lens.shape[0]
    seg_start = cu_q_lens  # [S+1]; segment S is the padding tokens
    seg_end = jnp.concatenate([cu_q_lens[1:], jnp.full((1,), num_tokens, jnp.int32)])
    seg_kv = jnp.concatenate([kv_lens, jnp.zeros((1,), jnp.int32)])
    seg_len = seg_end - seg_start
    skipped = (seg_len <= skip_up_to) & (jnp.arange(num_seq_slots + 1) < num_seq_slots)
    base = seg_start - seg_start % align
    seg_blocks = jnp.where(skipped | (seg_len <= 0), 0, (seg_end - base + tokens - 1) // tokens)
    ends = jnp.cumsum(seg_blocks)
    total = num_blocks(num_tokens, num_seq_slots, tokens, align)
    block = ends[-1] - 1 - jnp.arange(total, dtype=jnp.int32)
    # The segment of a block is the number of segments that end at or before it.
    seg = jnp.sum(ends[None, :] <= block[:, None], axis=1, dtype=jnp.int32)
    seg = jnp.minimum(seg, num_seq_slots)
    row0 = base[seg] + (block - (ends[seg] - seg_blocks[seg])) * tokens
    first = jnp.maximum(row0, seg_start[seg])
    count = jnp.where(block >= 0, jnp.clip(seg_end[seg] - first, 0, row0 + tokens - first), 0)
    return plan_columns(
        seg,
        first,
        count,
        seg_end[seg],
        seg_kv[seg],
        num_seq_slots=num_seq_slots,
        block_kv=block_kv,
        causal=causal,
        sliding_window=sliding_window,
    )


def plan_short_sequences(
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    tokens: int,
    block_kv: int,
    causal: bool,
    sliding_window: int | None,
) -> jax.Array:
    """The plan (as `plan_blocks`) of the short-sequence launch, i32[9, S]: step s takes
    sequence s whole if it has 1 to `tokens` tokens, and nothing otherwise."""
    num_seq_slots = kv_lens.shape[0]
    seq = jnp.arange(num_seq_slots, dtype=jnp.int32)
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    count = jnp.where(q_len <= tokens, q_len, 0)
    return plan_columns(
        seq,
        cu_q_lens[:-1],
        count,
        cu_q_lens[1:],
        kv_lens,
        num_seq_slots=num_seq_slots,
        block_kv=block_kv,
        causal=causal,
        sliding_window=sliding_window,
    )


def plan_columns(
    seg, first, count, seq_end, kv_len, *, num_seq_slots, block_kv, causal, sliding_window
):
    """Plan columns for blocks of `count` tokens from `first` of segments `seg` (S: padding)
    that end at token `seq_end` and have `kv_len` keys."""
    pos = kv_len - seq_end + first  # bottom-right alignment: kv_len - q_len + i
    last = pos + count - 1
    # Keys some row sees, [lo, hi), and keys every row sees, [full_lo, full_hi).
    hi = jnp.clip(last + 1, 0, kv_len) if causal else kv_len
    full_hi = jnp.clip(pos + 1, 0, kv_len) if causal else kv_len
    if sliding_window is None:
        lo = full_lo = jnp.zeros_like(pos)
    else:
        lo = jnp.maximum(pos - sliding_window + 1, 0)
        full_lo = jnp.maximum(last - sliding_window + 1, 0)
    nonempty = (count > 0) & (hi > lo)
    tile_lo = jnp.where(nonempty, lo // block_kv, 0)
    tile_hi = jnp.where(nonempty, (hi + block_kv - 1) // block_kv, 0)
    full_tile_lo = jnp.clip((full_lo + block_kv - 1) // block_kv, tile_lo, tile_hi)
    full_tile_hi = jnp.clip(full_hi // block_kv, full_tile_lo, tile_hi)
    # The padding pseudo-sequence has no page-table row: it reads no keys, but the kernel's
    # page lookups must stay in bounds.
    seq = jnp.minimum(seg, num_seq_slots - 1)
    columns = [seq, first, count, pos, kv_len, tile_lo, full_tile_lo, full_tile_hi, tile_hi]
    return jnp.stack(columns).astype(jnp.int32)
