"""The page pool: which pages are free and which sequence owns which page, as a pytree.

Every function is pure and jittable, and the pool is donated so that XLA updates it in place.
A reservation the pool cannot satisfy leaves it unchanged and returns `ok = False`: no partial
allocation, and no page is ever owned by two sequences.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("free", "page_indices", "kv_lens", "num_owned"),
    meta_fields=("page_size",),
)
@dataclasses.dataclass(frozen=True)
class PagePool:
    """Page ownership for up to `max_seqs` sequence slots.

    free: bool[P], True for pages no sequence owns.
    page_indices: i32[max_seqs, pages_per_seq]; row s lists the pages of slot s in order,
      -1 past `num_owned[s]` (an id no kernel write ever lands on).
    kv_lens: i32[max_seqs], tokens each slot holds (0 when the slot is empty).
    num_owned: i32[max_seqs], pages each slot owns.
    page_size: tokens per page (static).
    """

    free: jax.Array
    page_indices: jax.Array
    kv_lens: jax.Array
    num_owned: jax.Array
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.free.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.page_indices.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.page_indices.shape[1]


def create_pool(num_pages: int, page_size: int, max_seqs: int, pages_per_seq: int) -> PagePool:
    """An empty pool of `num_pages` pages for `max_seqs` slots of up to `pages_per_seq` pages."""
    for name, value in (
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("max_seqs", max_seqs),
        ("pages_per_seq", pages_per_seq),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return PagePool(
        free=jnp.ones((num_pages,), bool),
        page_indices=jnp.full((max_seqs, pages_per_seq), -1, jnp.int32),
        kv_lens=jnp.zeros((max_seqs,), jnp.int32),
        num_owned=jnp.zeros((max_seqs,), jnp.int32),
        page_size=page_size,
    )


@functools.partial(jax.jit, donate_argnums=0)
def reserve(pool: PagePool, seq_ids: jax.Array, new_lens: jax.Array) -> tuple[PagePool, jax.Array]:
    """Grow sequences to `new_lens` tokens, taking the pages they need from the free list.

    Args:
      pool: the pool (donated).
      seq_ids: i32[N] slots; a slot may repeat (its largest length counts); a negative id is
        padding and ignored.
      new_lens: i32[N] lengths after this step's tokens; a length never shrinks here.

    Returns:
      `(pool, ok)`. When a slot id is >= max_seqs, a length outside
      [0, pages_per_seq * page_size], or the free pages do not cover every request, `ok` is
      False and the pool comes back unchanged.
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    new_lens = jnp.asarray(new_lens, jnp.int32)
    capacity = pool.pages_per_seq * pool.page_size
    padding = seq_ids < 0
    valid = jnp.all(
        padding | ((seq_ids < pool.max_seqs) & (new_lens >= 0) & (new_lens <= capacity))
    )
    target = pool.kv_lens.at[_slot_or_oob(pool, seq_ids)].max(
        jnp.clip(new_lens, 0, capacity), mode="drop"
    )
    extra = jnp.maximum(0, -(-target // pool.page_size) - pool.num_owned)
    ok = valid & (jnp.sum(extra) <= jnp.sum(pool.free))

    # The free page ids, ascending (entries past the free count are never taken); slot s takes
    # the next `extra[s]` of them. A prefix sum and a scatter, not a sort: the engine reserves
    # every decode step, and a sort of the pool's flags is a visible part of a step.
    rank = jnp.cumsum(pool.free, dtype=jnp.int32) - 1
    free_ids = (
        jnp.zeros((pool.num_pages,), jnp.int32)
        .at[jnp.where(pool.free, rank, pool.num_pages)]
        .set(jnp.arange(pool.num_pages, dtype=jnp.int32), mode="drop")
    )
    first = jnp.cumsum(extra) - extra
    k = jnp.arange(pool.pages_per_seq, dtype=jnp.int32)[None, :]
    owned = pool.num_owned[:, None]
    fresh = (k >= owned) & (k < owned + extra[:, None])
    fresh_ids = free_ids[jnp.clip(first[:, None] + k - owned, 0, pool.num_pages - 1)]
    taken = (
        jnp.zeros_like(pool.free)
        .at[jnp.where(fresh, fresh_ids, pool.num_pages)]
        .set(True, mode="drop")
    )
    grown = PagePool(
        free=pool.free & ~taken,
        page_indices=jnp.where(fresh, fresh_ids, pool.page_indices),
        kv_lens=target,
        num_owned=pool.num_owned + extra,
        page_size=pool.page_size,
    )
    return jax.tree.map(lambda new, old: jnp.where(ok, new, old), grown, pool), ok


@functools.partial(jax.jit, donate_argnums=0)
def release(pool: PagePool, seq_ids: jax.Array) -> PagePool:
    """Free every page of the slots `seq_ids` (i32[N]; ids outside [0, max_seqs) are ignored)
    and empty those slots."""
    gone = jnp.zeros((pool.max_seqs,), bool).at[_slot_or_oob(pool, seq_ids)].set(True, mode="drop")
    k = jnp.arange(pool.pages_per_seq)[None, :]
    returned = gone[:, None] & (k < pool.num_owned[:, None])
    back = (
        jnp.zeros_like(pool.free)
        .at[jnp.where(returned, pool.page_indices, pool.num_pages)]
        .set(True, mode="drop")
    )
    return PagePool(
        free=pool.free | back,
        page_indices=jnp.where(gone[:, None], -1, pool.page_indices),
        kv_lens=jnp.where(gone, 0, pool.kv_lens),
        num_owned=jnp.where(gone, 0, pool.num_owned),
        page_size=pool.page_size,
    )


@jax.jit
def batch_metadata(pool: PagePool, seq_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The `kv_lens` i32[N] and `page_indices` i32[N, pages_per_seq] of a step over slots
    `seq_ids` (i32[N]); an id outside [0, max_seqs) gives an empty padding row."""
    seq_ids = _slot_or_oob(pool, seq_ids)
    kv_lens = pool.kv_lens.at[seq_ids].get(mode="fill", fill_value=0)
    page_indices = pool.page_indices.at[seq_ids].get(mode="fill", fill_value=-1)
    return kv_lens, page_indices


def _slot_or_oob(pool: PagePool, seq_ids: jax.Array) -> jax.Array:
    # Map negative ids past the end too: JAX would otherwise wrap -1 to the last slot.
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    return jnp.where(seq_ids >= 0, seq_ids, pool.max_seqs)


def num_free_pages(pool: PagePool) -> jax.Array:
    """Pages no sequence owns (i32 scalar)."""
    return jnp.sum(pool.free, dtype=jnp.int32)
