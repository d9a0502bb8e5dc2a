"""The specification of jaxpaged's attention ops in plain `jnp` (implementation `"xla"`).

Every kernel is tested against these functions, and they are tested against a float64 loop.
They gather each query token's sequence KV through the page table, so memory grows with
`tokens x pages_per_seq x page_size`; tokens are processed in blocks to bound it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import apply_soft_cap, sanitize_metadata, visible

# Tokens per gather block: bounds the [block, L, Hkv, D] working set of the reference.
_TOKEN_BLOCK = 16


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """Sequence id, position in the sequence, and liveness of every token of a ragged batch.

    `cu_q_lens` i32[S+1] and `kv_lens` i32[S] must be sanitized (`sanitize_metadata`). Returns
    `seq` i32[T], `pos` i32[T] (`kv_len - q_len + i`) and `live` bool[T] (False for padding).
    """
    num_seq_slots = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # "compare_all" is one fusion; the default binary search is a while loop, which on GPUs
    # costs a loop of small kernels and a predicate read per trip.
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right", method="compare_all").astype(jnp.int32)
    seq = jnp.minimum(seq, num_seq_slots - 1)
    live = t < cu_q_lens[-1]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, live


def ragged_paged_attention_reference(
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
) -> tuple[jax.Array, jax.Array]:
    """Attention of a ragged batch over paged KV, computed in float32.

    Args: as `jaxpaged.ragged_paged_attention` (shapes are checked there).
    Returns: `out` [T, Hq, D] in `q.dtype` and `lse` f32[T, Hq].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
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
    seq, pos, live = token_positions(meta.cu_q_lens, meta.kv_lens, num_tokens)
    max_len = meta.page_indices.shape[1] * page_size
    key_pos = jnp.arange(max_len, dtype=jnp.int32)

    def attend(args):
        q_t, s, p, alive = args  # [Hq, D], scalars
        keys_ok = visible(
            p,
            key_pos,
            jnp.where(alive, meta.kv_lens[s], 0),
            causal=causal,
            sliding_window=sliding_window,
        )  # [L]
        pages = meta.page_indices[s]
        k = k_pages[pages].reshape(max_len, num_kv_heads, head_dim)
        v = v_pages[pages].reshape(max_len, num_kv_heads, head_dim)
        # Zero the invisible keys before any arithmetic: unused pages may hold NaN.
        k = jnp.where(keys_ok[:, None, None], k, 0).astype(jnp.float32)
        v = jnp.where(keys_ok[:, None, None], v, 0).astype(jnp.float32)
        q_g = q_t.reshape(num_kv_heads, group, head_dim).astype(jnp.float32)
        logits = jnp.einsum("hgd,lhd->hgl", q_g, k, precision=lax.Precision.HIGHEST) * sm_scale
        logits = apply_soft_cap(logits, logits_soft_cap)
        logits = jnp.where(keys_ok, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        p_ = jnp.exp(logits - m_safe)
        denom = jnp.sum(p_, axis=-1)
        out = jnp.einsum("hgl,lhd->hgd", p_, v, precision=lax.Precision.HIGHEST)
        empty = denom == 0.0
        out = out / jnp.where(empty, 1.0, denom)[..., None]
        lse = jnp.where(empty, -jnp.inf, m_safe[..., 0] + jnp.log(jnp.where(empty, 1.0, denom)))
        return out.reshape(num_q_heads, head_dim), lse.reshape(num_q_heads)

    out, lse = lax.map(attend, (q, seq, pos, live), batch_size=_TOKEN_BLOCK)
    return out.astype(q.dtype), lse


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`ragged_paged_attention_reference` with one token per sequence slot.

    Args: as `jaxpaged.paged_decode_attention` (shapes are checked there).
    Returns: `out` [S, Hq, D] in `q.dtype` and `lse` f32[S, Hq].
    """
    num_seq_slots = q.shape[0]
    return ragged_paged_attention_reference(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        jnp.arange(num_seq_slots + 1, dtype=jnp.int32),
        jnp.asarray(num_seq_slots, jnp.int32),
        sm_scale=sm_scale,
        causal=True,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
