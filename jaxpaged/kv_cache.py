"""Writing new K/V tokens into the page pool, and copying pages for forked sequences."""

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
    num_pages, page_size = k_pages.shape[:2]
    slots = kv_slots(
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        num_tokens=k.shape[0],
        num_pages=num_pages,
        page_size=page_size,
    )
    return write_kv(k_pages, v_pages, k, v, slots)


def kv_slots(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    num_pages: int,
    page_size: int,
) -> jax.Array:
    """i32[T]: the slot `page * page_size + offset` of the pool that each of a step's tokens is
    written to (`append_kv`'s rule), or -1 for a token that writes nothing.

    The slots are the same for every layer: a step computes them once (`StepMetadata`) and each
    layer's `write_kv` is then a plain scatter.
    """
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
    return jnp.where(ok, page * page_size + pos % page_size, -1).astype(jnp.int32)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Write token t's K/V into pool slot `slots[t]` (`kv_slots`); -1, or any slot outside the
    pool, writes nothing. Pages are donated; returns the updated `(k_pages, v_pages)`.

    The slots of live tokens must be distinct, as `kv_slots` gives them for a pool's sequences:
    positions differ within a sequence, and a page that receives tokens is held by its
    sequence alone. Where they repeat (bad metadata), one of the writes wins.
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
    if slots.shape != k.shape[:1] or jnp.dtype(slots.dtype) != jnp.int32:
        raise ValueError(f"slots must be i32[T={k.shape[0]}]; got {slots.dtype}{list(slots.shape)}")
    ok = (slots >= 0) & (slots < num_pages * page_size)
    shape = (num_pages * page_size, num_kv_heads, head_dim)

    def write(pages, new):
        return _set_rows(pages.reshape(shape), slots, ok, new).reshape(pages.shape)

    return write(k_pages, k), write(v_pages, v)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_pages(
    k_pages: jax.Array, v_pages: jax.Array, src_pages: jax.Array, dst_pages: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Copy whole pages: page `dst_pages[i]` becomes a copy of page `src_pages[i]`.

    The copies `fork` asks for: a forked sequence's private copy of its source's partly
    filled last page. Call it for every layer's pages.

    Args:
      k_pages, v_pages: [P, page_size, Hkv, D] one layer's page pool (donated).
      src_pages, dst_pages: i32[N] page ids; a pair with either id outside [0, P) (such as
        fork's -1 padding) copies nothing. The destinations should be distinct (fork's are);
        where one repeats, one of its copies wins.

    Returns:
      The updated `(k_pages, v_pages)`; every copy reads the pages as they were before any
      write.
    """
    src_pages = jnp.asarray(src_pages, jnp.int32)
    dst_pages = jnp.asarray(dst_pages, jnp.int32)
    if src_pages.ndim != 1 or src_pages.shape != dst_pages.shape:
        raise ValueError(
            f"src_pages and dst_pages must be i32[N] of one length; got shapes "
            f"{src_pages.shape}, {dst_pages.shape}"
        )
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4:
        raise ValueError(
            f"k_pages and v_pages must have one shape [P, page_size, Hkv, D]; got "
            f"{k_pages.shape}, {v_pages.shape}"
        )
    num_pages = k_pages.shape[0]
    ok = (src_pages >= 0) & (src_pages < num_pages) & (dst_pages >= 0) & (dst_pages < num_pages)
    src = jnp.clip(src_pages, 0, num_pages - 1)

    def copy(pages):
        return _set_rows(pages, dst_pages, ok, pages[src])

    return copy(k_pages), copy(v_pages)


def _set_rows(rows: jax.Array, index: jax.Array, ok: jax.Array, new: jax.Array) -> jax.Array:
    """`rows.at[index].set(new)` for the entries where `ok` (bool[N]); the others write nothing.

    They get distinct indices past the end, so that the indices are unique and XLA scatters
    without ordering the updates. Where `ok` entries do share an index (bad metadata), one of
    them wins.
    """
    nowhere = rows.shape[0] + jnp.arange(index.shape[0], dtype=jnp.int32)
    index = jnp.where(ok, index, nowhere)
    return rows.at[index].set(new, mode="drop", unique_indices=True)
