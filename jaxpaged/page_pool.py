"""The page pool: which sequences hold which pages, and how many hold each, as a pytree.

Every function is pure and jittable, and the pool is donated so that XLA updates it in place.
A reservation or fork the pool cannot satisfy leaves it unchanged and returns `ok = False`: no
partial allocation. Sequences share pages only through `fork` and `attach`, and only full
pages: a page held by two sequences lies wholly below both their `kv_len`s, and since lengths
only grow, every write (at positions `>= kv_len`) lands in a page its sequence holds alone.
Pages can also be held without a slot (`retain`, `drop`): a prefix cache keeps computed pages
that way for the sequences that later `attach` them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("refcount", "page_indices", "kv_lens", "num_owned"),
    meta_fields=("page_size",),
)
@dataclasses.dataclass(frozen=True)
class PagePool:
    """Page ownership for up to `max_seqs` sequence slots.

    refcount: i32[P], how many slots hold each page (0: free). Above 1 only for full pages.
    page_indices: i32[max_seqs, pages_per_seq]; row s lists the pages of slot s in order,
      -1 past `num_owned[s]` (an id no kernel write ever lands on).
    kv_lens: i32[max_seqs], tokens each slot holds (0 when the slot is empty; a slot is active
      when it holds tokens).
    num_owned: i32[max_seqs], pages each slot holds, `ceil(kv_len / page_size)`.
    page_size: tokens per page (static).
    """

    refcount: jax.Array
    page_indices: jax.Array
    kv_lens: jax.Array
    num_owned: jax.Array
    page_size: int

    @property
    def free(self) -> jax.Array:
        """bool[P], True for pages no slot holds."""
        return self.refcount == 0

    @property
    def num_pages(self) -> int:
        return self.refcount.shape[0]

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
        refcount=jnp.zeros((num_pages,), jnp.int32),
        page_indices=jnp.full((max_seqs, pages_per_seq), -1, jnp.int32),
        kv_lens=jnp.zeros((max_seqs,), jnp.int32),
        num_owned=jnp.zeros((max_seqs,), jnp.int32),
        page_size=page_size,
    )


@functools.partial(jax.jit, donate_argnums=0)
def reserve(pool: PagePool, seq_ids: jax.Array, new_lens: jax.Array) -> tuple[PagePool, jax.Array]:
    """Grow sequences to `new_lens` tokens, taking the pages they need from the free list.

    The new tokens land in the sequence's last page or in fresh pages, which it holds alone
    (pages are shared only while full), so growing never needs a copy.

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
    free_ids, num_free = _free_ids(pool)
    ok = valid & (jnp.sum(extra) <= num_free)

    # Slot s takes the next `extra[s]` free pages.
    first = jnp.cumsum(extra) - extra
    k = jnp.arange(pool.pages_per_seq, dtype=jnp.int32)[None, :]
    owned = pool.num_owned[:, None]
    fresh = (k >= owned) & (k < owned + extra[:, None])
    fresh_ids = free_ids[jnp.clip(first[:, None] + k - owned, 0, pool.num_pages - 1)]
    grown = PagePool(
        refcount=pool.refcount.at[jnp.where(fresh, fresh_ids, pool.num_pages)].set(1, mode="drop"),
        page_indices=jnp.where(fresh, fresh_ids, pool.page_indices),
        kv_lens=target,
        num_owned=pool.num_owned + extra,
        page_size=pool.page_size,
    )
    return _if_ok(ok, grown, pool), ok


@functools.partial(jax.jit, donate_argnums=0)
def truncate(pool: PagePool, seq_ids: jax.Array, new_lens: jax.Array) -> tuple[PagePool, jax.Array]:
    """Shrink sequences to `new_lens` tokens, giving back the pages past their new ends: the
    undo of a `reserve` whose tokens were not all written (a decode block reserves its steps'
    pages before it runs them, and a row that stops early gives the rest back).

    Args:
      pool: the pool (donated).
      seq_ids: i32[N] slots; a slot may repeat (its smallest length counts); a negative id is
        padding and ignored.
      new_lens: i32[N] lengths, each in [0, the slot's kv_len]: a length never grows here.

    Returns:
      `(pool, ok)`. Each page past a slot's new last page loses that holder, and is free once
      it has none. When a slot id is >= max_seqs, a length is negative or above its slot's
      kv_len, or a slot would end inside a page other sequences share (its next token would
      be written into their page), `ok` is False and the pool comes back unchanged.
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    new_lens = jnp.asarray(new_lens, jnp.int32)
    padding = seq_ids < 0
    slots = _slot_or_oob(pool, seq_ids)
    current = pool.kv_lens.at[slots].get(mode="fill", fill_value=0)
    valid = jnp.all(padding | ((seq_ids < pool.max_seqs) & (new_lens >= 0) & (new_lens <= current)))
    target = pool.kv_lens.at[slots].min(jnp.maximum(new_lens, 0), mode="drop")
    keep = -(-target // pool.page_size)
    # The page a slot's next token goes to, when it is the slot's partly filled last page.
    last = pool.page_indices[jnp.arange(pool.max_seqs), jnp.maximum(keep - 1, 0)]
    ends_mid_page = (target % pool.page_size != 0) & (target < pool.kv_lens)
    shared = pool.refcount.at[last].get(mode="fill", fill_value=0) > 1
    ok = valid & ~jnp.any(ends_mid_page & shared)
    k = jnp.arange(pool.pages_per_seq, dtype=jnp.int32)[None, :]
    returned = (k >= keep[:, None]) & (k < pool.num_owned[:, None])
    shrunk = PagePool(
        refcount=pool.refcount.at[jnp.where(returned, pool.page_indices, pool.num_pages)].add(
            -1, mode="drop"
        ),
        page_indices=jnp.where(returned, -1, pool.page_indices),
        kv_lens=target,
        num_owned=jnp.minimum(pool.num_owned, keep),
        page_size=pool.page_size,
    )
    return _if_ok(ok, shrunk, pool), ok


@functools.partial(jax.jit, donate_argnums=0)
def fork(
    pool: PagePool, src: jax.Array, dst_seq_ids: jax.Array
) -> tuple[PagePool, jax.Array, tuple[jax.Array, jax.Array]]:
    """Start the empty slots `dst_seq_ids` as copies of the active slot `src`, sharing its pages.

    Each destination gets the source's `kv_len` and page list; the full pages are shared (their
    refcount grows by the number of destinations). A partly filled last page (`kv_len %
    page_size != 0`) is not: each destination gets a fresh page in its place, and the caller
    copies the source's last page into it with `copy_pages`, in every layer, before the
    destination's next step. Shared pages are thus always full, and appends, which write at
    positions >= kv_len, land only in pages their sequence holds alone. Fork once the source's
    K/V are written: the copies read its last page.

    Args:
      pool: the pool (donated).
      src: i32[] the slot to copy; it must be active (kv_len > 0).
      dst_seq_ids: i32[N] the new slots: empty, distinct and < max_seqs; a negative id is
        padding and ignored.

    Returns:
      `(pool, ok, (src_pages, dst_pages))`, the page lists i32[N] of the copies the caller
      owes (`copy_pages(k_pages, v_pages, src_pages, dst_pages)`), -1 where there is none.
      When `src` is not an active slot, a destination is >= max_seqs, active or repeated, or
      the free pages do not cover the copies, `ok` is False, the pool comes back unchanged
      and both page lists are all -1; `validate_fork` names the broken rule on the host.
    """
    src = jnp.asarray(src, jnp.int32)
    dst = jnp.asarray(dst_seq_ids, jnp.int32)
    if src.ndim != 0 or dst.ndim != 1:
        raise ValueError(
            f"src must be a scalar and dst_seq_ids 1-D; got shapes {src.shape}, {dst.shape}"
        )
    src_slot = _slot_or_oob(pool, src)
    src_len = pool.kv_lens.at[src_slot].get(mode="fill", fill_value=0)
    src_owned = pool.num_owned.at[src_slot].get(mode="fill", fill_value=0)
    src_row = pool.page_indices.at[src_slot].get(mode="fill", fill_value=-1)
    live = dst >= 0
    dst_slot = _slot_or_oob(pool, dst)
    active = pool.kv_lens.at[dst_slot].get(mode="fill", fill_value=0) > 0
    repeats = jnp.zeros((pool.max_seqs,), jnp.int32).at[dst_slot].add(1, mode="drop")
    copy = live & (src_len % pool.page_size != 0)
    free_ids, num_free = _free_ids(pool)
    ok = (
        (src_len > 0)  # also False for a src outside [0, max_seqs): its length reads as 0
        & jnp.all(~live | ((dst < pool.max_seqs) & ~active))
        & jnp.all(repeats <= 1)
        & (jnp.sum(copy) <= num_free)
    )

    fresh = free_ids[jnp.clip(jnp.cumsum(copy) - 1, 0, pool.num_pages - 1)]
    k = jnp.arange(pool.pages_per_seq, dtype=jnp.int32)
    rows = jnp.where(copy[:, None] & (k == src_owned - 1), fresh[:, None], src_row)
    shared = k < src_len // pool.page_size
    refcount = (
        pool.refcount.at[jnp.where(shared, src_row, pool.num_pages)]
        .add(jnp.sum(live, dtype=jnp.int32), mode="drop")
        .at[jnp.where(copy, fresh, pool.num_pages)]
        .set(1, mode="drop")
    )
    forked = PagePool(
        refcount=refcount,
        page_indices=pool.page_indices.at[dst_slot].set(rows, mode="drop"),
        kv_lens=pool.kv_lens.at[dst_slot].set(src_len, mode="drop"),
        num_owned=pool.num_owned.at[dst_slot].set(src_owned, mode="drop"),
        page_size=pool.page_size,
    )
    copied = copy & ok
    src_pages = jnp.where(copied, src_row[jnp.maximum(src_owned - 1, 0)], -1)
    dst_pages = jnp.where(copied, fresh, -1)
    return _if_ok(ok, forked, pool), ok, (src_pages, dst_pages)


def validate_fork(pool: PagePool, src, dst_seq_ids) -> None:
    """Raise `ValueError` naming the first rule that `fork(pool, src, dst_seq_ids)` breaks.

    On the host, with the pool's lengths and the ids concrete (inside `jit` a bad fork is a
    no-op with `ok = False`). Rules: `src` is a scalar slot in [0, max_seqs) that holds tokens;
    `dst_seq_ids` is 1-D, and each of its ids that is not negative (padding) lies in
    [0, max_seqs), is not `src`, holds no tokens and appears once. A pool too full for the
    copies breaks no rule: `fork` then returns `ok = False`.
    """
    kv_lens = np.asarray(pool.kv_lens)
    src, dst = np.asarray(src), np.asarray(dst_seq_ids)
    if src.ndim != 0 or dst.ndim != 1:
        raise ValueError(
            f"src must be a scalar and dst_seq_ids 1-D; got shapes {src.shape}, {dst.shape}"
        )
    src = int(src)
    if not 0 <= src < pool.max_seqs:
        raise ValueError(f"src {src} is outside [0, max_seqs={pool.max_seqs})")
    if kv_lens[src] == 0:
        raise ValueError(f"src slot {src} is inactive (kv_len 0): there is nothing to fork")
    seen: set[int] = set()
    for d in dst.tolist():
        if d < 0:
            continue
        if d >= pool.max_seqs:
            raise ValueError(
                f"destination {d} is outside [0, max_seqs={pool.max_seqs}) (negative ids are "
                "padding)"
            )
        if d == src:
            raise ValueError(f"destination {d} is the source slot itself")
        if kv_lens[d] > 0:
            raise ValueError(
                f"destination slot {d} is active (kv_len {kv_lens[d]}); release it first"
            )
        if d in seen:
            raise ValueError(f"destination slot {d} appears more than once")
        seen.add(d)


@functools.partial(jax.jit, donate_argnums=0)
def attach(
    pool: PagePool, seq_ids: jax.Array, page_indices: jax.Array, kv_lens: jax.Array
) -> tuple[PagePool, jax.Array]:
    """Start the empty slots `seq_ids` on full pages that hold their first tokens already.

    Slot `seq_ids[i]` gets `kv_lens[i]` tokens, a multiple of `page_size`, in the first
    `kv_lens[i] / page_size` pages of `page_indices[i]`, each of which gains a holder. The pages
    must be held already (by a slot, or without one through `retain`): a free page holds no
    K/V. They are full, so shared as forked pages are: the slot's appends go to fresh pages.

    Args:
      pool: the pool (donated).
      seq_ids: i32[N] the slots: empty, distinct and < max_seqs; a negative id is padding.
      page_indices: i32[N, pages_per_seq] their pages in order (entries past each row's pages
        are ignored).
      kv_lens: i32[N] their lengths.

    Returns:
      `(pool, ok)`. When a slot is out of range, active or repeated, a length is negative, not
      a multiple of page_size or over the slot's capacity, or a listed page is out of range or
      free, `ok` is False and the pool comes back unchanged.
    """
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    live = seq_ids >= 0
    slots = _slot_or_oob(pool, seq_ids)
    num_owned = kv_lens // pool.page_size
    k = jnp.arange(pool.pages_per_seq, dtype=jnp.int32)[None, :]
    used = live[:, None] & (k < num_owned[:, None])
    held = pool.refcount.at[page_indices].get(mode="fill", fill_value=0) > 0
    active = pool.kv_lens.at[slots].get(mode="fill", fill_value=0) > 0
    repeats = jnp.zeros((pool.max_seqs,), jnp.int32).at[slots].add(1, mode="drop")
    capacity = pool.pages_per_seq * pool.page_size
    ok = (
        jnp.all(
            ~live
            | (
                (seq_ids < pool.max_seqs)
                & ~active
                & (kv_lens >= 0)
                & (kv_lens % pool.page_size == 0)
                & (kv_lens <= capacity)
            )
        )
        & jnp.all(repeats <= 1)
        & jnp.all(~used | ((page_indices >= 0) & (page_indices < pool.num_pages) & held))
    )
    attached = PagePool(
        refcount=pool.refcount.at[jnp.where(used, page_indices, pool.num_pages)].add(
            1, mode="drop"
        ),
        page_indices=pool.page_indices.at[slots].set(
            jnp.where(used, page_indices, -1), mode="drop"
        ),
        kv_lens=pool.kv_lens.at[slots].set(kv_lens, mode="drop"),
        num_owned=pool.num_owned.at[slots].set(num_owned, mode="drop"),
        page_size=pool.page_size,
    )
    return _if_ok(ok, attached, pool), ok


@functools.partial(jax.jit, donate_argnums=0)
def retain(pool: PagePool, page_ids: jax.Array) -> tuple[PagePool, jax.Array]:
    """Hold the pages `page_ids` (i32[N], negative ids pad; a repeated id is held once per
    occurrence) without a slot, so that they outlive their slots' `release`. Returns `(pool,
    ok)`: `ok` is False, and the pool unchanged, when an id is out of range, its page is free
    (it holds no K/V to keep) or a slot's partly filled last page (shared pages are full)."""
    page_ids = jnp.asarray(page_ids, jnp.int32)
    live = page_ids >= 0
    held = pool.refcount.at[page_ids].get(mode="fill", fill_value=0) > 0
    k = jnp.arange(pool.pages_per_seq, dtype=jnp.int32)[None, :]
    last = (k < pool.num_owned[:, None]) & ((k + 1) * pool.page_size > pool.kv_lens[:, None])
    partial = (
        jnp.zeros((pool.num_pages,), bool)
        .at[jnp.where(last, pool.page_indices, pool.num_pages)]
        .set(True, mode="drop")
    )
    full = ~partial.at[page_ids].get(mode="fill", fill_value=True)
    ok = jnp.all(~live | ((page_ids < pool.num_pages) & held & full))
    return _if_ok(ok, _add_refs(pool, page_ids, 1), pool), ok


@functools.partial(jax.jit, donate_argnums=0)
def drop(pool: PagePool, page_ids: jax.Array) -> tuple[PagePool, jax.Array]:
    """Let go of pages held by `retain` (i32[N], negative ids pad; one hold per occurrence); a
    page is free once it has no holder. Returns `(pool, ok)`: `ok` is False, and the pool
    unchanged, when an id is out of range or would lose more holders than it has."""
    page_ids = jnp.asarray(page_ids, jnp.int32)
    counts = (
        jnp.zeros_like(pool.refcount).at[page_ids].add(jnp.where(page_ids >= 0, 1, 0), mode="drop")
    )
    ok = jnp.all(page_ids < pool.num_pages) & jnp.all(counts <= pool.refcount)
    return _if_ok(ok, _add_refs(pool, page_ids, -1), pool), ok


def _add_refs(pool: PagePool, page_ids: jax.Array, delta: int) -> PagePool:
    index = jnp.where(page_ids >= 0, page_ids, pool.num_pages)
    return dataclasses.replace(pool, refcount=pool.refcount.at[index].add(delta, mode="drop"))


@functools.partial(jax.jit, donate_argnums=0)
def release(pool: PagePool, seq_ids: jax.Array) -> PagePool:
    """Empty the slots `seq_ids` (i32[N]; ids outside [0, max_seqs) are ignored, repeats count
    once). Each of their pages loses a holder and is free once it has none."""
    gone = jnp.zeros((pool.max_seqs,), bool).at[_slot_or_oob(pool, seq_ids)].set(True, mode="drop")
    k = jnp.arange(pool.pages_per_seq)[None, :]
    returned = gone[:, None] & (k < pool.num_owned[:, None])
    return PagePool(
        refcount=pool.refcount.at[jnp.where(returned, pool.page_indices, pool.num_pages)].add(
            -1, mode="drop"
        ),
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


def _free_ids(pool: PagePool) -> tuple[jax.Array, jax.Array]:
    """The free page ids ascending (i32[P]; entries past the free count are 0 and never taken)
    and the free count (i32[])."""
    # A prefix sum and a scatter, not a sort: the engine reserves every decode step, and a sort
    # of the pool's flags is a visible part of a step.
    free = pool.free
    rank = jnp.cumsum(free, dtype=jnp.int32) - 1
    free_ids = (
        jnp.zeros((pool.num_pages,), jnp.int32)
        .at[jnp.where(free, rank, pool.num_pages)]
        .set(jnp.arange(pool.num_pages, dtype=jnp.int32), mode="drop")
    )
    return free_ids, rank[-1] + 1


def _if_ok(ok: jax.Array, new: PagePool, old: PagePool) -> PagePool:
    # All or nothing: a refused request returns the pool it was given.
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def num_free_pages(pool: PagePool) -> jax.Array:
    """Pages no slot holds (i32 scalar)."""
    return jnp.sum(pool.free, dtype=jnp.int32)
