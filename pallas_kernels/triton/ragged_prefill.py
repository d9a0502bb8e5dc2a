"""Ragged paged attention in Pallas lowered through Triton: prefill, chunked prefill and decode
tokens of a flat ragged batch in one call.

The grid is (q block, KV head). A q block is a run of up to `tokens` consecutive tokens of one
sequence; its score tile has one row per (token, query head of the KV head's group), so each K/V
tile gathered from the pages is loaded once for the whole GQA group. Which block each grid step
takes, and which key tiles it visits, is planned in XLA from the batch metadata
(`pallas_kernels.block_plan`): the grid size depends only on the padded sizes, so a new batch
of the same sizes never compiles again.

Sequences of a few tokens (decode tokens, speculative drafts) would leave most rows of a large
tile empty, and their work is bound by reading K/V, not by the tensor cores: a second launch of
the same kernel with 16-row tiles takes them (`plan_short_sequences`), writing into the outputs
of the first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import block_plan
from pallas_kernels.block_plan import plan_blocks, plan_short_sequences
from pallas_kernels.common import (
    alias_outputs,
    dot_f32,
    finalize,
    logits_base2,
    online_softmax_step,
    poison_enabled,
    poisoned_outputs,
    sanitize_metadata,
    visible,
)

HEAD_DIMS = (64, 128, 256)
# (block_q, block_kv) of the long-sequence launch for 16-bit inputs, per head dim.
_TILES_16BIT = {64: (128, 128), 128: (128, 128), 256: (64, 32)}


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Tile sizes and Triton launch options of the prefill kernel.

    Attributes:
      block_q: rows of a score tile, i.e. query tokens per block times the KV-head group size
        padded to a power of two (a block holds `max(1, block_q // padded_group)` tokens).
      block_kv: keys per K/V tile; independent of the page size (keys are gathered one by one
        through the page table).
      num_warps, num_stages: Triton's warps per program and software-pipelining depth.
      carry_page_ids: how a K/V tile's page ids reach its loads. False: the tile's own
        page-table lookup, which Triton's pipeliner copies asynchronously to shared memory one
        stage before the K/V tile, so K/V is prefetched `ceil((num_stages - 2) / 2)` tiles
        ahead and the loop has no synchronous global load. True: looked up one iteration early
        into registers, so K/V is prefetched `num_stages - 1` tiles ahead, but ptxas copies
        the loaded ids into the carried registers before the loop's back edge: every iteration
        ends waiting for a global load issued behind the K/V copies in flight.
      short_block_q, short_block_kv, short_num_warps, short_num_stages, short_carry_page_ids:
        the same for the launch that takes the sequences of at most
        `max(1, short_block_q // padded_group)` tokens; `short_block_q=0` leaves every sequence
        to the first launch.
    """

    block_q: int = 128
    block_kv: int = 128
    num_warps: int = 8
    num_stages: int = 5
    carry_page_ids: bool = False
    short_block_q: int = 16
    short_block_kv: int = 64
    short_num_warps: int = 4
    short_num_stages: int = 3
    short_carry_page_ids: bool = True

    @classmethod
    def default(cls, head_dim: int, dtype) -> PrefillConfig:
        """Defaults for the H100/H200. Long launch: page ids through the pipeliner and K/V
        prefetched two tiles ahead (5 stages), tiles that Triton 3.6 compiles for sm_90 in one
        program per SM (ptxas: at most 64 bytes of spills, at D=128). Short launch: page ids
        carried, K/V two tiles ahead (3 stages)."""
        if jnp.dtype(dtype) == jnp.float32:
            # IEEE float32 dots run on FMA units, not tensor cores: only small tiles fit in
            # registers. Float32 is for checking numbers, not for speed. With 2 stages the
            # pipeliner leaves a tile's own page lookup synchronous, right before its K/V copy.
            size = 32 if head_dim == 64 else 16
            return cls(
                size,
                size,
                4,
                2,
                carry_page_ids=True,
                short_block_q=16,
                short_block_kv=16,
                short_num_stages=2,
            )
        block_q, block_kv = _TILES_16BIT[head_dim]
        # Short-sequence tiles of 16 KiB of K (and of V) per stage: several programs per SM
        # keep enough loads in flight for work that is bound by memory.
        return cls(block_q, block_kv, short_block_kv=8192 // head_dim)

    def __post_init__(self):
        sizes = ["block_q", "block_kv", "short_block_kv"]
        if self.short_block_q:
            sizes.append("short_block_q")
        for name in sizes:
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(
                    f"PrefillConfig.{name} must be a power of two >= 16 (Triton dots and loads "
                    f"need it){' or 0' if name == 'short_block_q' else ''}; got {size}"
                )
        for name in ("num_warps", "short_num_warps"):
            warps = getattr(self, name)
            if warps < 1 or warps & (warps - 1):
                raise ValueError(f"PrefillConfig.{name} must be a power of two; got {warps}")
        for name in ("num_stages", "short_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrefillConfig.{name} must be >= 1; got {getattr(self, name)}")


def _prefill_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    pages_ref,
    *refs,
    sm_scale: float,
    causal: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    tokens: int,
    group: int,
    block_kv: int,
    carry_page_ids: bool,
):
    """One q block of one KV head.

    plan_ref i32[9, blocks]; q_ref [T, Hq, D]; k_ref, v_ref [P, page_size, Hkv, D];
    pages_ref i32[S, pages_per_seq]; refs ends with o_ref [T, Hq, D] and lse_ref f32[T, Hq]
    (before them, when the launch updates given outputs, those buffers as aliased inputs).
    """
    o_ref, lse_ref = refs[-2:]
    block, kv_head = pl.program_id(0), pl.program_id(1)
    page_size = k_ref.shape[1]
    head_dim = q_ref.shape[2]
    (
        seq,
        first_token,
        num_tokens,
        first_pos,
        kv_len,
        tile_lo,
        full_lo,
        full_hi,
        tile_hi,
    ) = block_plan.read_block(plan_ref, block)

    # Row r of the tile is token r // padded_group of the block and query head r % padded_group
    # of the group (both powers of two, so these are shifts and masks).
    padded_group = pl.next_power_of_2(group)
    rows = tokens * padded_group
    row = jnp.arange(rows, dtype=jnp.int32)
    token_in_block = lax.div(row, padded_group)
    head_in_group = lax.rem(row, padded_group)
    row_ok = (token_in_block < num_tokens) & (head_in_group < group)
    token = first_token + token_in_block
    head = kv_head * group + head_in_group
    # Whole-array indices (no slices) so that masked loads and stores also run in interpret mode.
    dim = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    q_at = (token[:, None], head[:, None], dim)
    q = plgpu.load(q_ref.at[q_at], mask=row_ok[:, None], other=0.0)  # [rows, D]
    q_pos = first_pos + token_in_block

    pages_per_seq = pages_ref.shape[1]

    def tile_pages(index):
        """Page of every key of tile `index`, [block_kv]; 0 past the page-table row."""
        slot_page = lax.div(index * block_kv + jnp.arange(block_kv, dtype=jnp.int32), page_size)
        return plgpu.load(pages_ref.at[seq, slot_page], mask=slot_page < pages_per_seq, other=0)

    def tile(index, next_index, carry, *, masked: bool):
        # See PrefillConfig.carry_page_ids for the two ways of fetching the page ids.
        if carry_page_ids:
            acc, m, l, page = carry
            next_page = tile_pages(next_index)
        else:
            acc, m, l = carry
            page = tile_pages(index)
        key = index * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        kv_at = (page[:, None], lax.rem(key, page_size)[:, None], kv_head, dim)
        if masked:
            # Slots past kv_len may hold garbage, even NaN: keep them out of the loads.
            key_ok = key < kv_len
            k = plgpu.load(k_ref.at[kv_at], mask=key_ok[:, None], other=0.0)
            v = plgpu.load(v_ref.at[kv_at], mask=key_ok[:, None], other=0.0)
        else:
            k, v = k_ref[kv_at], v_ref[kv_at]
        logits = dot_f32(q, k, contract_b=1)  # [rows, block_kv]
        logits2 = logits_base2(logits, sm_scale, logits_soft_cap)
        if masked:
            ok = visible(
                q_pos[:, None], key[None, :], kv_len, causal=causal, sliding_window=sliding_window
            )
            logits2 = jnp.where(ok, logits2, -jnp.inf)
        m, l, alpha, p = online_softmax_step(m, l, logits2)
        pv = dot_f32(p.astype(v.dtype), v, contract_b=0)
        state = (acc * alpha[:, None] + pv, m, l)
        return (*state, next_page) if carry_page_ids else state

    def full_tile(index, carry):
        return tile(index, index + 1, carry, masked=False)

    # The masked tiles are the window's leading edge [tile_lo, full_lo) and the causal
    # diagonal and kv_len end [full_hi, tile_hi): one loop walks both.
    num_lead = full_lo - tile_lo

    def edge_index(i):
        return jnp.where(i < num_lead, tile_lo + i, full_hi + (i - num_lead))

    def edge_tile(i, carry):
        return tile(edge_index(i), edge_index(i + 1), carry, masked=True)

    def with_pages(state, first_index):
        return (*state[:3], tile_pages(first_index)) if carry_page_ids else state[:3]

    state = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    state = lax.fori_loop(full_lo, full_hi, full_tile, with_pages(state, full_lo))
    state = lax.fori_loop(
        0, num_lead + tile_hi - full_hi, edge_tile, with_pages(state, edge_index(0))
    )
    acc, m, l = state[:3]
    out, lse = finalize(acc, m, l)
    # The store's rows must not be the very index arrays of the Q load: Triton would then
    # compute the [rows, D] pointer tensor once and keep it in registers across the K/V loops
    # (255 registers per thread and spills, a much slower kernel: benchmarks/NOTES.md). `l` is
    # a sum of exponentials, never negative, so `never` is all false; the compiler cannot know
    # that, and computes the store's pointers after the loops.
    never = l < 0.0
    token_out = token + never.astype(jnp.int32)
    ok_out = row_ok & ~never
    out_at = (token_out[:, None], head[:, None], dim)
    plgpu.store(o_ref.at[out_at], out.astype(o_ref.dtype), mask=ok_out[:, None])
    plgpu.store(lse_ref.at[token_out, head], lse, mask=ok_out)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    config: PrefillConfig | None = None,
    interpret: bool = False,
    short_sequences: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Attention of a flat ragged batch over paged KV (bottom-right causal), one Triton kernel.

    Semantics are those of `jaxpaged.reference.ragged_paged_attention_reference`; the public
    entry point with full argument checks is `jaxpaged.ragged_paged_attention`.

    Args:
      q: [T, Hq, D] float32/bfloat16/float16, D in (64, 128, 256).
      k_pages, v_pages: [P, page_size, Hkv, D], q's dtype; Hq a multiple of Hkv.
      kv_lens: i32[S]; page_indices: i32[S, pages_per_seq]; cu_q_lens: i32[S+1];
      num_seqs: i32[] or i32[1].
      sm_scale, causal, sliding_window, logits_soft_cap: as the reference.
      config: tiles and launch options; None picks `PrefillConfig.default(D, q.dtype)`.
      interpret: run in Pallas interpret mode (CPU).
      short_sequences: False leaves every sequence to the first launch (`short_block_q=0`).

    Returns:
      `out` [T, Hq, D] in q's dtype and `lse` f32[T, Hq] (natural log); rows with no visible
      key and padding tokens give 0 and -inf.
    """
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"the Triton prefill kernel needs q's head dim D in {HEAD_DIMS}; got "
            f"q.shape {q.shape} (D = {head_dim})"
        )
    if config is None:
        config = PrefillConfig.default(head_dim, q.dtype)
    if not short_sequences:
        config = dataclasses.replace(config, short_block_q=0)
    return _ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=float(sm_scale),
        causal=bool(causal),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        config=config,
        interpret=interpret,
        poison=poison_enabled(),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "causal",
        "sliding_window",
        "logits_soft_cap",
        "config",
        "interpret",
        "poison",
    ),
)
def _ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    causal,
    sliding_window,
    logits_soft_cap,
    config,
    interpret,
    poison,
):
    del poison  # a static key only (see `poison_outputs`)
    num_tokens, num_q_heads, _ = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if num_tokens == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in _out_shapes(q))
    group = num_q_heads // num_kv_heads
    meta = sanitize_metadata(
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        num_tokens=num_tokens,
        num_pages=num_pages,
        page_size=page_size,
    )
    options = dict(causal=causal, sliding_window=sliding_window)
    tokens = max(1, config.block_q // pl.next_power_of_2(group))
    short_tokens = short_tokens_of(config, group)
    plan = plan_blocks(
        meta.cu_q_lens,
        meta.kv_lens,
        num_tokens=num_tokens,
        tokens=tokens,
        block_kv=config.block_kv,
        skip_up_to=short_tokens,
        **options,
    )
    outputs = _launch(
        q,
        k_pages,
        v_pages,
        meta.page_indices,
        plan,
        poisoned_outputs(_out_shapes(q)),
        name="ragged_paged_prefill",
        tokens=tokens,
        block_kv=config.block_kv,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        carry_page_ids=config.carry_page_ids,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        interpret=interpret,
        **options,
    )
    if not short_tokens:
        return outputs
    return launch_short_sequences(
        q,
        k_pages,
        v_pages,
        meta,
        outputs,
        config=config,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        interpret=interpret,
        **options,
    )


def short_tokens_of(config: PrefillConfig, group: int) -> int:
    """Most tokens of a sequence that the short-sequence launch takes (0: no such launch)."""
    if not config.short_block_q:
        return 0
    return max(1, config.short_block_q // pl.next_power_of_2(group))


def launch_short_sequences(
    q,
    k_pages,
    v_pages,
    meta,
    outputs,
    *,
    config: PrefillConfig,
    sm_scale,
    causal,
    sliding_window,
    logits_soft_cap,
    interpret,
):
    """The short-sequence launch: attention of every sequence of 1 to `short_tokens_of(config,
    group)` tokens, written into `outputs` (out [T, Hq, D], lse f32[T, Hq]) in place; other
    rows keep what they hold. `meta` is sanitized (`sanitize_metadata`)."""
    options = dict(causal=causal, sliding_window=sliding_window)
    tokens = short_tokens_of(config, q.shape[1] // k_pages.shape[2])
    plan = plan_short_sequences(
        meta.cu_q_lens, meta.kv_lens, tokens=tokens, block_kv=config.short_block_kv, **options
    )
    return _launch(
        q,
        k_pages,
        v_pages,
        meta.page_indices,
        plan,
        outputs,
        name="ragged_paged_prefill_short",
        tokens=tokens,
        block_kv=config.short_block_kv,
        num_warps=config.short_num_warps,
        num_stages=config.short_num_stages,
        carry_page_ids=config.short_carry_page_ids,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        interpret=interpret,
        **options,
    )


def _launch(
    q,
    k_pages,
    v_pages,
    page_indices,
    plan,
    outputs,
    *,
    name,
    tokens,
    block_kv,
    num_warps,
    num_stages,
    carry_page_ids,
    sm_scale,
    causal,
    sliding_window,
    logits_soft_cap,
    interpret,
):
    """One launch of the kernel over the q blocks of `plan`. It writes only the rows of its
    blocks: `outputs`, when given, are (out, lse) buffers that it updates in place."""
    num_q_heads, num_kv_heads = q.shape[1], k_pages.shape[2]
    inputs, aliases = alias_outputs([plan, q, k_pages, v_pages, page_indices], outputs)
    kernel = functools.partial(
        _prefill_kernel,
        sm_scale=sm_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        tokens=tokens,
        group=num_q_heads // num_kv_heads,
        block_kv=block_kv,
        carry_page_ids=carry_page_ids,
    )
    return pl.pallas_call(
        kernel,
        grid=(plan.shape[1], num_kv_heads),
        out_shape=_out_shapes(q),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)


def _out_shapes(q: jax.Array) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """`out` [T, Hq, D] in q's dtype and `lse` f32[T, Hq]."""
    return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:2], jnp.float32))
