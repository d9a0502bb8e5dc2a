"""Writing new K/V tokens into the page pool."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpaged.reference import token_positions
from pallas_kernels.common import sanitize_metadata


@functools.partial(jax.jit, donate_argnums=(0, 1))
def append_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Write each new token's K/V into its page slot; the pages are donated and updated in place.

    Args:
      k_pages, v_pages: [P, page_size, Hkv, D] one layer's page pool (donated).
      k, v: [T, Hkv, D] the new tokens, packed like `q` of `ragged_paged_attention`.
      kv_lens, page_indices, cu_q_lens, num_seqs: the step's batch metadata (`kv_lens` counts
        the new tokens).

    Returns:
      The updated `(k_pages, v_pages)`. Token i of sequence s goes to position
      `kv_lens[s] - q_len + i`; padding tokens, and tokens whose position or page id falls
      outside the page table or the pool, write nothing.
    """
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k and v must have shape [T, Hkv={num_kv_heads}, D={head_dim}]; "
            f"got {k.shape}, {v.shape}"
        )
    if k.dtype != k_pages.dtype or v.dtype != v_pages.dtype:
        raise TypeError(
            f"k and v must have the pages' dtype {k_pages.dtype}; got {k.dtype}, {v.dtype}"
        )
    num_tokens = k.shape[0]
    pages_per_seq = page_indices.shape[1]
    meta = sanitize_metadata(
        kv_lens,
        page_indices,
        cu_q_lens,
        jnp.asarray(num_seqs, jnp.int32),
        num_tokens=num_tokens,
        num_pages=num_pages,
        page_size=page_size,
    )
    seq, pos, live = token_positions(meta.cu_q_lens, meta.kv_lens, num_tokens)
    page_slot = pos // page_size
    # Read the raw page id: clamping a bad one would redirect the write into another page.
    page = page_indices[seq, jnp.clip(page_slot, 0, pages_per_seq - 1)]
    ok = live & (pos >= 0) & (page_slot < pages_per_seq) & (page >= 0) & (page < num_pages)
    # Tokens that write nothing get distinct indices past the end, so that the indices are
    # unique (live tokens of a pool's sequences never share a slot: positions differ within a
    # sequence and sequences own disjoint pages) and XLA scatters without ordering updates.
    # Where a bad page table does make two tokens share a slot, one of them wins, as before.
    nowhere = num_pages * page_size + jnp.arange(num_tokens, dtype=jnp.int32)
    flat = jnp.where(ok, page * page_size + pos % page_size, nowhere)
    shape = (num_pages * page_size, num_kv_heads, head_dim)

    def write(pages, new):
        flat_pages = pages.reshape(shape).at[flat].set(new, mode="drop", unique_indices=True)
        return flat_pages.reshape(pages.shape)

    k_pages, v_pages = write(k_pages, k), write(v_pages, v)
    return k_pages, v_pages
