"""Split-KV paged decode attention as a Pallas Triton kernel.

One query token per sequence slot attends to that sequence's paged KV. One program per (KV head,
sequence, split) streams one fixed chunk of the sequence's visible keys through the page table,
with all query heads of the KV head's group as the rows of one tile, so that each K and V tile
is read once. A split past the sequence's end loops zero times. The partial outputs and their
LSEs are merged by one more Pallas kernel (`pallas_kernels.triton.merge`).

Semantics are `jaxpaged.reference.ragged_paged_attention_reference` with one token per sequence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    H200_NUM_SMS,
    alias_outputs,
    device_num_sms,
    dot_f32,
    finalize,
    logits_base2,
    online_softmax_step,
    poison_enabled,
    poisoned_outputs,
    visible,
)
from pallas_kernels.triton.merge import merge_partials

# `tl.dot` needs at least 16 rows: a group of fewer query heads is padded (and masked) to this.
_MIN_DOT_ROWS = 16
# `choose_num_splits`: programs wanted per SM, and the least work per split in tiles.
_PROGRAMS_PER_SM = 8
# 8, not 4: at B=1 and long contexts, splits of 4 tiles ran slower than fewer splits of 8
# (benchmarks/NOTES.md).
_MIN_TILES_PER_SPLIT = 8
# Tokens per KV tile for 2-byte inputs, per head dim: 16 KiB per K (and per V) tile.
_DEFAULT_BLOCK_KV = {64: 128, 128: 64, 256: 32}


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of the Triton decode kernel.

    Attributes:
      block_kv: keys per tile (power of two >= 16). Each loop step reads a [block_kv, D] K and V
        tile for one KV head; a tile need not align with pages.
      num_warps: warps per program.
      num_stages: Triton software-pipelining depth. The page-id gather of a tile takes a stage
        before its K and V loads, so K and V get a second buffer (the next tile's loads
        overlapping this tile's math) only from 5 stages on (Triton 3.6 for sm_90); with fewer,
        the programs resident on an SM (about 4 at the defaults) keep the loads in flight.
    """

    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.block_kv < 16 or self.block_kv & (self.block_kv - 1):
            raise ValueError(f"block_kv must be a power of two >= 16; got {self.block_kv}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two; got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1; got {self.num_stages}")

    @classmethod
    def default(cls, head_dim: int, dtype: jax.typing.DTypeLike) -> DecodeConfig:
        """The default config for head dim D (64, 128 or 256 only) and the input dtype.

        Tiles of 16 KiB per K and per V at 2 bytes per element (`block_kv = 8192 / D`); float32
        gets half the keys per tile, keeping the shared memory of a pipeline stage the same.
        """
        if head_dim not in _DEFAULT_BLOCK_KV:
            raise ValueError(
                f"the Triton decode kernel has default configs for head dims "
                f"{tuple(_DEFAULT_BLOCK_KV)}; q has head dim D={head_dim}. Pass a DecodeConfig "
                f"(D must be a power of two >= 16 for Triton tiles)"
            )
        block_kv = _DEFAULT_BLOCK_KV[head_dim] * 2 // jnp.dtype(dtype).itemsize
        return cls(block_kv=max(block_kv, 16))


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_kv_len: int,
    *,
    block_kv: int,
    num_sms: int = H200_NUM_SMS,
) -> int:
    """KV splits per sequence for a batch shape (static: no recompilation per step).

    Rule: the grid has `num_seqs * num_kv_heads * splits` programs. Take the fewest splits that
    give at least `_PROGRAMS_PER_SM` (8) programs per SM, so that the last, partial wave and
    uneven sequence lengths cost little; but give every split at least `_MIN_TILES_PER_SPLIT`
    (8) tiles of `block_kv` keys of the longest possible sequence (`max_kv_len`), so that the
    fixed cost of a program (loading q, filling the pipeline, writing a partial state) stays
    small against its KV traffic. A large batch thus gets one or a few splits, a single long
    sequence many. Always >= 1.

    >>> choose_num_splits(64, 8, 4096, block_kv=64)  # 512 programs per split
    3
    >>> choose_num_splits(1, 8, 32768, block_kv=64)  # capped by 8 tiles per split
    64
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = pl.cdiv(_PROGRAMS_PER_SM * num_sms, programs)
    most = max(max_kv_len // (_MIN_TILES_PER_SPLIT * block_kv), 1)
    return max(min(wanted, most), 1)


def _decode_kernel(
    q_ref,  # [S, Hkv, group, D]
    k_ref,  # [P, page_size, Hkv, D]
    v_ref,  # [P, page_size, Hkv, D]
    kv_lens_ref,  # i32[S]
    page_indices_ref,  # i32[S, pages_per_seq]
    *refs,  # optional poisoned inputs (ignored), then o_ref [splits, S, Hkv, group, D], lse_ref
    block_h: int,
    block_kv: int,
    chunk: int,
    sm_scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
):
    o_ref, lse_ref = refs[-2:]
    head, seq, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group, head_dim = q_ref.shape[2], q_ref.shape[3]
    num_pages, page_size = k_ref.shape[:2]

    # The clamps of `sanitize_metadata`, done here to save an XLA kernel per step: bad metadata
    # gives wrong numbers, never an out-of-bounds read.
    kv_len = jnp.clip(kv_lens_ref[seq], 0, page_indices_ref.shape[1] * page_size)
    # The token at kv_len - 1 sees keys [lo, kv_len); split i takes [lo + i*chunk, +chunk).
    lo = 0 if sliding_window is None else jnp.maximum(kv_len - sliding_window, 0)
    start = lo + split * chunk
    length = jnp.maximum(jnp.minimum(start + chunk, kv_len) - start, 0)
    # `chunk` is a whole number of tiles, so only a sequence's last tile can be partial.
    num_full_tiles = length // block_kv

    # All integer indexers (no slices): gathers lower the same in Triton and in interpret mode.
    rows = jnp.arange(block_h)
    cols = jnp.arange(head_dim)[None, :]
    row_ok = rows < group
    q = plgpu.load(q_ref.at[seq, head, rows[:, None], cols], mask=row_ok[:, None], other=0)

    # No kv_len check on interior tiles: every key there is visible and in a live page.
    def tile(tile_start, carry, *, masked: bool):
        acc, m, l = carry
        pos = tile_start + jnp.arange(block_kv)
        if masked:
            keep = visible(kv_len - 1, pos, kv_len, causal=True, sliding_window=sliding_window)
            page_kw, kv_kw = dict(mask=keep, other=0), dict(mask=keep[:, None], other=0)
        else:
            page_kw = kv_kw = {}
        # One page id per key (equal for the keys of a page), read once for K and V.
        page = plgpu.load(page_indices_ref.at[seq, lax.div(pos, page_size)], **page_kw)
        page = jnp.clip(page, 0, num_pages - 1)
        kv_idx = (page[:, None], lax.rem(pos, page_size)[:, None], head, cols)
        k = plgpu.load(k_ref.at[kv_idx], **kv_kw)  # [block_kv, D]
        scores = dot_f32(q, k, contract_b=1)  # [block_h, block_kv]
        logits2 = logits_base2(scores, sm_scale, logits_soft_cap)
        if masked:
            logits2 = jnp.where(keep[None, :], logits2, -jnp.inf)
        m, l, alpha, p = online_softmax_step(m, l, logits2)
        v = plgpu.load(v_ref.at[kv_idx], **kv_kw)
        acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v, contract_b=0)
        return acc, m, l

    carry = (
        jnp.zeros((block_h, head_dim), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    carry = lax.fori_loop(
        0,
        num_full_tiles,
        lambda i, c: tile(start + i * block_kv, c, masked=False),
        carry,
    )
    carry = lax.cond(
        length % block_kv > 0,
        lambda c: tile(start + num_full_tiles * block_kv, c, masked=True),
        lambda c: c,
        carry,
    )
    out, lse = finalize(*carry)
    plgpu.store(
        o_ref.at[split, seq, head, rows[:, None], cols],
        out.astype(o_ref.dtype),
        mask=row_ok[:, None],
    )
    plgpu.store(lse_ref.at[split, seq, head, rows], lse, mask=row_ok)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    num_splits: int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    config: DecodeConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Split-KV decode: one new query token per sequence slot over paged KV.

    Args:
      q: [S, Hq, D] float32/bfloat16/float16, the token of every sequence slot; it sits at
        position `kv_len - 1`.
      k_pages, v_pages: [P, page_size, Hkv, D], q's dtype. Query head h reads KV head
        `h // (Hq // Hkv)`.
      kv_lens: i32[S], KV length including the new token; 0 marks an inactive slot.
      page_indices: i32[S, pages_per_seq], position j of sequence s lives in page
        `page_indices[s, j // page_size]`, slot `j % page_size`. Entries past a sequence's
        length and the pages they name are never read.
      num_splits: KV splits per sequence; None picks `choose_num_splits(...)`.
      sm_scale: logits scale, default `1/sqrt(D)`.
      sliding_window: keys `j > kv_len - 1 - sliding_window` only.
      logits_soft_cap: `cap * tanh(logits / cap)`.
      config: tuning knobs; None picks `DecodeConfig.default(D, q.dtype)`.
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      `out` [S, Hq, D] in q's dtype and the natural-log `lse` f32[S, Hq]; inactive slots give
      0 and -inf. Invalid metadata inside `jit` may give wrong numbers but no out-of-bounds
      access (it is clamped as by `pallas_kernels.common.sanitize_metadata`).
    """
    num_seq_slots, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    if config is None:
        config = DecodeConfig.default(head_dim, q.dtype)
    elif not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be a triton.paged_decode.DecodeConfig; got {config!r}")
    elif head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(
            f"the Triton decode kernel needs a power-of-two head dim >= 16; q has D={head_dim}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq ({num_q_heads}) must be a multiple of Hkv ({num_kv_heads})")
    visible_len = page_indices.shape[1] * page_size
    if sliding_window is not None:
        visible_len = min(visible_len, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seq_slots,
            num_kv_heads,
            visible_len,
            block_kv=config.block_kv,
            num_sms=device_num_sms(),
        )
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    # Chunks are whole tiles (so only a sequence's last tile needs masks) covering the window.
    chunk = pl.cdiv(pl.cdiv(visible_len, num_splits), config.block_kv) * config.block_kv
    return _paged_decode(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        num_splits=num_splits,
        chunk=chunk,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        config=config,
        interpret=interpret,
        poison=poison_enabled(),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_splits",
        "chunk",
        "sm_scale",
        "sliding_window",
        "logits_soft_cap",
        "config",
        "interpret",
        "poison",
    ),
)
def _paged_decode(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    *,
    num_splits,
    chunk,
    sm_scale,
    sliding_window,
    logits_soft_cap,
    config,
    interpret,
    poison,
):
    del poison  # a static key only (see `poison_outputs`)
    num_seq_slots, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    # With one split the kernel's output is final: write it in q's dtype and skip the merge.
    part_dtype = q.dtype if num_splits == 1 else jnp.float32
    out_shape = (
        jax.ShapeDtypeStruct(
            (num_splits, num_seq_slots, num_kv_heads, group, head_dim), part_dtype
        ),
        jax.ShapeDtypeStruct((num_splits, num_seq_slots, num_kv_heads, group), jnp.float32),
    )
    inputs = [q.reshape(num_seq_slots, num_kv_heads, group, head_dim), k_pages, v_pages]
    inputs, aliases = alias_outputs([*inputs, kv_lens, page_indices], poisoned_outputs(out_shape))
    kernel = functools.partial(
        _decode_kernel,
        block_h=max(_MIN_DOT_ROWS, pl.next_power_of_2(group)),
        block_kv=config.block_kv,
        chunk=chunk,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    outs, lses = pl.pallas_call(
        kernel,
        # Heads fastest: programs launched together read neighbouring memory (the Hkv rows of
        # one page slot are adjacent). Splits slowest: late chunks, which only long sequences
        # fill, launch last, so a ragged batch ends on short programs.
        grid=(num_kv_heads, num_seq_slots, num_splits),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="paged_decode",
    )(*inputs)
    outs = outs.reshape(num_splits, num_seq_slots, num_q_heads, head_dim)
    lses = lses.reshape(num_splits, num_seq_slots, num_q_heads)
    if num_splits == 1:
        return outs[0], lses[0]
    rows = num_seq_slots * num_q_heads
    out, lse = merge_partials(
        outs.reshape(1, num_splits, rows, head_dim),
        lses.reshape(1, num_splits, rows),
        out_dtype=q.dtype,
        interpret=interpret,
    )
    return out.reshape(q.shape), lse.reshape(num_seq_slots, num_q_heads)
