"""Property tests of the page pool against a plain Python model of page ownership and sharing
(slots, forks, pages attached and pages retained without a slot), and of the K/V that forked
sequences read through it."""

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpaged

NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ = 12, 4, 5, 5
CAPACITY = PAGE_SIZE * PAGES_PER_SEQ
N = 3  # ids per call: fixed so the jitted functions compile once

seq_id = st.integers(-1, MAX_SEQS)  # -1 is padding, MAX_SEQS is out of range
seq_ids = st.lists(seq_id, min_size=N, max_size=N)
reserve_op = st.tuples(
    st.just("reserve"),
    seq_ids,
    # Page-aligned lengths too: a fork of one shares every page and copies none.
    st.lists(
        st.one_of(
            st.integers(0, CAPACITY + 2), st.integers(0, PAGES_PER_SEQ).map(PAGE_SIZE.__mul__)
        ),
        min_size=N,
        max_size=N,
    ),
)
release_op = st.tuples(st.just("release"), seq_ids)


def truncate_op(lens) -> st.SearchStrategy:
    """Truncations of any ids to any lengths (negative ones too), and of the active slots to
    lengths they hold (mid-page and page-aligned alike), which are valid unless the new last
    page is shared."""
    any_truncate = st.tuples(
        st.just("truncate"), seq_ids, st.lists(st.integers(-1, CAPACITY), min_size=N, max_size=N)
    )
    active = [s for s, n in enumerate(lens) if n]
    if not active:
        return any_truncate
    held = st.sampled_from(active).flatmap(lambda s: st.tuples(st.just(s), st.integers(0, lens[s])))
    rows = st.lists(held, min_size=1, max_size=N).map(
        lambda r: ([s for s, _ in r] + [-1] * (N - len(r)), [n for _, n in r] + [0] * (N - len(r)))
    )
    return st.one_of(any_truncate, rows.map(lambda r: ("truncate", *r)))


def fork_op(lens) -> st.SearchStrategy:
    """Forks of any ids (-1 to len(lens)), and forks likely to be valid given the slots'
    lengths `lens`: of an active source into distinct empty slots (most of the others are
    refused)."""
    any_id = st.integers(-1, len(lens))
    any_fork = st.tuples(st.just("fork"), any_id, st.lists(any_id, min_size=N, max_size=N))
    active = [s for s, n in enumerate(lens) if n]
    if not active:
        return any_fork
    empty = [s for s, n in enumerate(lens) if not n]
    into_empty = st.lists(st.sampled_from([-1, *empty]), max_size=N, unique=True).map(
        lambda dsts: dsts + [-1] * (N - len(dsts))
    )
    return st.one_of(any_fork, st.tuples(st.just("fork"), st.sampled_from(active), into_empty))


def _full_pages(model) -> list[list[int]]:
    """Runs of held full pages: each slot's full pages, and the retained ones."""
    runs = [
        [model.page[name] for name in row[: n // PAGE_SIZE]]
        for row, n in zip(model.rows, model.lens, strict=True)
    ]
    return [*runs, [model.page[name] for name in model.retained][:PAGES_PER_SEQ]]


def retain_op(model) -> st.SearchStrategy:
    """Any ids (held, free, out of range, padding; most are refused), and full held pages."""
    held = sorted(model.page[name] for name in model.live())
    free = sorted(set(range(NUM_PAGES)) - set(held))
    any_ids = st.lists(st.sampled_from([-1, NUM_PAGES, *held, *free[:1]]), min_size=N, max_size=N)
    full = sorted({p for run in _full_pages(model) for p in run})
    full_ids = st.lists(st.sampled_from([-1, *full]), min_size=N, max_size=N)
    return st.tuples(st.just("retain"), st.one_of(any_ids, full_ids))


def drop_op(model) -> st.SearchStrategy:
    """Some of the retained holds (valid), or with a free or out-of-range id (refused)."""
    retained = [model.page[name] for name in model.retained]
    held = {model.page[name] for name in model.live()}
    bad = [NUM_PAGES, *sorted(set(range(NUM_PAGES)) - held)[:1]]

    def ids(holds, extra):
        return (holds[:N] + extra + [-1] * N)[:N]

    some = st.permutations(retained).flatmap(
        lambda holds: st.integers(0, min(N, len(holds))).map(lambda n: holds[:n])
    )
    return st.tuples(
        st.just("drop"),
        st.builds(ids, some, st.one_of(st.just([]), st.sampled_from(bad).map(lambda b: [b]))),
    )


def attach_op(model) -> st.SearchStrategy:
    """Rows of any slot id, a run of held full pages and its length or a length that is not
    page-aligned (most are refused), and one row into an empty slot with padding around it."""
    prefix = st.sampled_from(_full_pages(model)).flatmap(
        lambda run: st.integers(0, len(run)).map(lambda k: run[:k])
    )
    any_row = st.tuples(st.integers(-1, MAX_SEQS), prefix, st.integers(0, 2)).map(
        lambda r: (r[0], r[1], len(r[1]) * PAGE_SIZE + (r[2] == 2))
    )
    any_rows = st.lists(any_row, min_size=N, max_size=N)
    empty = [s for s, n in enumerate(model.lens) if n == 0]
    if not empty:
        return st.tuples(st.just("attach"), any_rows)
    one_row = st.builds(
        lambda d, pages, i: (
            [(-1, [], 0)] * i + [(d, pages, len(pages) * PAGE_SIZE)] + [(-1, [], 0)] * (N - 1 - i)
        ),
        st.sampled_from(empty),
        prefix,
        st.integers(0, N - 1),
    )
    return st.tuples(st.just("attach"), st.one_of(any_rows, one_row))


def _pages(num_tokens: int) -> int:
    return -(-num_tokens // PAGE_SIZE)


class Model:
    """Each slot's length and its pages as names, and the names retained without a slot: two
    holders hold one page where they hold one name. Which pool page a name is, the model
    leaves to the pool (`bind` reads it after each call; a name keeps its page)."""

    def __init__(self):
        self.lens = [0] * MAX_SEQS
        self.rows: list[list[int]] = [[] for _ in range(MAX_SEQS)]
        self.retained: list[int] = []
        self.page: dict[int, int] = {}
        self._names = itertools.count()

    def live(self) -> set[int]:
        return {name for row in self.rows for name in row} | set(self.retained)

    def num_free(self) -> int:
        return NUM_PAGES - len(self.live())

    def bind(self, pool) -> None:
        table = np.asarray(pool.page_indices)
        for s, row in enumerate(self.rows):
            for j, name in enumerate(row):
                assert self.page.setdefault(name, int(table[s, j])) == table[s, j], "page moved"

    def name_of(self, page: int) -> int | None:
        return next((n for n in self.live() if self.page[n] == page), None)

    def retain(self, ids) -> bool:
        names = [self.name_of(i) for i in ids if i >= 0]
        partial = {row[-1] for row, n in zip(self.rows, self.lens, strict=True) if n % PAGE_SIZE}
        if None in names or partial & set(names):
            return False
        self.retained += names
        return True

    def drop(self, ids) -> bool:
        names = [self.name_of(i) for i in ids if i >= 0]
        if None in names or collections.Counter(names) - collections.Counter(self.retained):
            return False
        for name in names:
            self.retained.remove(name)
        return True

    def attach(self, rows) -> bool:
        live = [(d, pages, n) for d, pages, n in rows if d >= 0]
        dsts = [d for d, _, _ in live]
        valid = len(set(dsts)) == len(dsts) and all(
            d < MAX_SEQS and self.lens[d] == 0 and n % PAGE_SIZE == 0 for d, _, n in live
        )
        names = [[self.name_of(p) for p in pages] for _, pages, _ in live]
        if not valid or any(None in row for row in names):
            return False
        for (d, _, n), row in zip(live, names, strict=True):
            self.lens[d], self.rows[d] = n, row
        return True

    def reserve(self, ids, new_lens) -> bool:
        want, valid = list(self.lens), True
        for s, n in zip(ids, new_lens, strict=True):
            if s < 0:
                continue
            valid &= s < MAX_SEQS and n <= CAPACITY
            if s < MAX_SEQS:
                want[s] = max(want[s], n)
        need = sum(_pages(w) - _pages(n) for w, n in zip(want, self.lens, strict=True))
        if not valid or need > self.num_free():
            return False
        for s, row in enumerate(self.rows):
            row += [next(self._names) for _ in range(_pages(want[s]) - len(row))]
        self.lens = want
        return True

    def truncate(self, ids, new_lens) -> bool:
        want, valid = list(self.lens), True
        for s, n in zip(ids, new_lens, strict=True):
            if s < 0:
                continue
            valid &= s < MAX_SEQS and 0 <= n <= (self.lens[s] if s < MAX_SEQS else 0)
            if s < MAX_SEQS:
                want[s] = min(want[s], n)
        if not valid:
            return False
        holders = collections.Counter(self.retained)
        for row in self.rows:
            holders.update(row)
        for s, (w, n) in enumerate(zip(want, self.lens, strict=True)):
            # The next token would land in the new last page: refused if others hold it.
            if w < n and w % PAGE_SIZE and holders[self.rows[s][_pages(w) - 1]] > 1:
                return False
        for s, w in enumerate(want):
            del self.rows[s][_pages(w) :]
        self.lens = want
        return True

    def fork(self, src, dsts) -> bool:
        live = [d for d in dsts if d >= 0]
        valid = (
            0 <= src < MAX_SEQS
            and self.lens[src] > 0
            and all(d < MAX_SEQS and self.lens[d] == 0 for d in live)
            and len(set(live)) == len(live)
        )
        if not valid:
            return False
        partial = self.lens[src] % PAGE_SIZE != 0
        if partial * len(live) > self.num_free():
            return False
        for d in live:
            self.lens[d] = self.lens[src]
            full = self.rows[src][: self.lens[src] // PAGE_SIZE]
            self.rows[d] = full + ([next(self._names)] if partial else [])
        return True

    def release(self, ids) -> None:
        for s in ids:
            if 0 <= s < MAX_SEQS:
                self.lens[s], self.rows[s] = 0, []


def _check(pool, model: Model) -> None:
    refcount, table, lens, owned = (
        np.asarray(x) for x in (pool.refcount, pool.page_indices, pool.kv_lens, pool.num_owned)
    )
    np.testing.assert_array_equal(lens, model.lens)
    np.testing.assert_array_equal(owned, [len(row) for row in model.rows])
    name_of: dict[int, int] = {}
    holders = np.zeros(NUM_PAGES, np.int64)
    for s, row in enumerate(model.rows):
        assert (table[s, len(row) :] == -1).all()
        for j, name in enumerate(row):
            page = int(table[s, j])
            assert 0 <= page < NUM_PAGES
            assert name_of.setdefault(page, name) == name, "unshared pages got one pool page"
            holders[page] += 1
    assert len(set(name_of.values())) == len(name_of), "a shared page got two pool pages"
    for name in model.retained:
        holders[model.page[name]] += 1
    # Refcounts are the holders: no page is free while held, none is held by nobody (leaked).
    np.testing.assert_array_equal(refcount, holders)
    assert int(jaxpaged.num_free_pages(pool)) == model.num_free()
    # A shared page is full for every holder: appends (at positions >= kv_len) never reach it.
    for s in range(MAX_SEQS):
        for j in range(owned[s]):
            if refcount[table[s, j]] > 1:
                assert (j + 1) * PAGE_SIZE <= lens[s], f"slot {s} can append into shared page"


def _assert_unchanged(pool, before) -> None:
    for new, old in zip(jax.tree.leaves(pool), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(new), old)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_pool_matches_model(data):
    pool = jaxpaged.create_pool(NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ)
    model = Model()
    for _ in range(data.draw(st.integers(1, 14), label="num_ops")):
        op = data.draw(
            st.one_of(
                reserve_op,
                truncate_op(model.lens),
                fork_op(model.lens),
                release_op,
                retain_op(model),
                drop_op(model),
                attach_op(model),
            )
        )
        before = jax.tree.map(np.array, pool)
        if op[0] in ("reserve", "truncate"):
            _, ids, new_lens = op
            pool, ok = getattr(jaxpaged, op[0])(
                pool, jnp.array(ids, jnp.int32), jnp.array(new_lens, jnp.int32)
            )
            assert bool(ok) == getattr(model, op[0])(ids, new_lens)
        elif op[0] == "fork":
            _, src, dsts = op
            pool, ok, copies = jaxpaged.fork(pool, jnp.int32(src), jnp.array(dsts, jnp.int32))
            assert bool(ok) == model.fork(src, dsts)
            # Each destination owes a copy of the source's last page iff that page is partial.
            want = np.full((2, N), -1)
            if ok and model.lens[src] % PAGE_SIZE:
                last = model.lens[src] // PAGE_SIZE
                for i, d in enumerate(dsts):
                    if d >= 0:
                        want[:, i] = pool.page_indices[src, last], pool.page_indices[d, last]
            np.testing.assert_array_equal(np.asarray(copies), want)
        elif op[0] in ("retain", "drop"):
            _, ids = op
            pool, ok = getattr(jaxpaged, op[0])(pool, jnp.array(ids, jnp.int32))
            assert bool(ok) == getattr(model, op[0])(ids)
        elif op[0] == "attach":
            _, rows = op
            table = np.full((N, PAGES_PER_SEQ), -1, np.int32)
            for i, (_, pages, _) in enumerate(rows):
                table[i, : len(pages)] = pages
            pool, ok = jaxpaged.attach(
                pool,
                jnp.array([d for d, _, _ in rows], jnp.int32),
                jnp.asarray(table),
                jnp.array([n for _, _, n in rows], jnp.int32),
            )
            assert bool(ok) == model.attach(rows)
        else:
            _, ids = op
            pool, ok = jaxpaged.release(pool, jnp.array(ids, jnp.int32)), True
            model.release(ids)
        if not ok:
            _assert_unchanged(pool, before)  # a refused request changes nothing
        model.bind(pool)
        _check(pool, model)


# The K/V tests: one K and one V value pair per token, in pages that start as NaN.
KV_SLOTS, KV_PAGES, MAX_APPEND, D = 4, 10, 6, 2


def _kv_pool():
    pool = jaxpaged.create_pool(KV_PAGES, PAGE_SIZE, KV_SLOTS, PAGES_PER_SEQ)
    pages = jnp.full((KV_PAGES, PAGE_SIZE, 1, D), jnp.nan, jnp.float32)
    return pool, (pages, pages + 0)


def _append(pages, pool, new: dict):
    """One step as the engine runs it: reserve the tokens `new[s]` (f32[n, 1, D]) of each slot
    s, then append them (K as given, V negated). Returns `(pages, pool, ok)`."""
    seq_ids = np.full(KV_SLOTS, -1, np.int32)
    cu_q_lens = np.zeros(KV_SLOTS + 1, np.int32)
    k = np.zeros((KV_SLOTS * MAX_APPEND, 1, D), np.float32)
    for i, (s, tokens) in enumerate(new.items()):
        seq_ids[i] = s
        k[cu_q_lens[i] : cu_q_lens[i] + len(tokens)] = tokens
        cu_q_lens[i + 1] = cu_q_lens[i] + len(tokens)
    cu_q_lens[len(new) + 1 :] = cu_q_lens[len(new)]
    cached, _ = jaxpaged.batch_metadata(pool, seq_ids)
    pool, ok = jaxpaged.reserve(pool, seq_ids, cached + np.diff(cu_q_lens))
    if not ok:  # the lengths miss the new tokens: writing them would overwrite cached ones
        return pages, pool, ok
    kv_lens, page_indices = jaxpaged.batch_metadata(pool, seq_ids)
    # No page that receives a token is read by another sequence of the step.
    jaxpaged.validate_batch(k, pages[0], kv_lens, page_indices, cu_q_lens, len(new))
    pages = jaxpaged.append_kv(
        *pages, jnp.asarray(k), jnp.asarray(-k), kv_lens, page_indices, cu_q_lens, len(new)
    )
    return pages, pool, ok


def _fork(pages, pool, src, dsts):
    pool, ok, copies = jaxpaged.fork(pool, jnp.int32(src), jnp.array(dsts, jnp.int32))
    return jaxpaged.copy_pages(*pages, *copies), pool, ok


def _check_readable(pages, pool, contents: list) -> None:
    """Every slot reads, through its page table up to its kv_len, exactly its own tokens."""
    kv_lens, table = jax.device_get(jaxpaged.batch_metadata(pool, jnp.arange(KV_SLOTS)))
    k, v = (np.asarray(p) for p in pages)
    for s, want in enumerate(contents):
        assert kv_lens[s] == len(want)
        pos = np.arange(kv_lens[s])
        slots = table[s, pos // PAGE_SIZE], pos % PAGE_SIZE
        np.testing.assert_array_equal(k[slots], want)
        np.testing.assert_array_equal(v[slots], -want)


kv_slot = st.integers(0, KV_SLOTS - 1)
# A step appends to one or several slots.
append_op = st.tuples(
    st.just("append"),
    st.dictionaries(kv_slot, st.integers(1, MAX_APPEND), min_size=1, max_size=KV_SLOTS),
)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_writes_never_reach_what_another_sequence_reads(data):
    """Appends to forked sequences (and to their sources) change only what the appending
    sequence reads: no write lands in a page another live sequence can read."""
    pool, pages = _kv_pool()
    contents = [np.zeros((0, 1, D), np.float32) for _ in range(KV_SLOTS)]
    values = itertools.count(1)
    for _ in range(data.draw(st.integers(1, 16), label="num_ops")):
        lens = [len(c) for c in contents]
        op = data.draw(st.one_of(append_op, fork_op(lens), st.tuples(st.just("release"), kv_slot)))
        if op[0] == "append":
            new = {
                s: np.array([next(values) for _ in range(n * D)], np.float32).reshape(n, 1, D)
                for s, n in op[1].items()
            }
            pages, pool, ok = _append(pages, pool, new)
            if ok:
                for s, tokens in new.items():
                    contents[s] = np.concatenate([contents[s], tokens])
        elif op[0] == "fork":
            _, src, dsts = op
            pages, pool, ok = _fork(pages, pool, src, dsts)
            if ok:
                for d in dsts:
                    if d >= 0:
                        contents[d] = contents[src].copy()
        else:
            pool = jaxpaged.release(pool, jnp.array([op[1]], jnp.int32))
            contents[op[1]] = contents[op[1]][:0]
        _check_readable(pages, pool, contents)


def test_forked_sequences_append_in_one_step_without_touching_each_other():
    """A 10-token sequence forked twice (its third page partly filled): each of the three
    appends its own tokens in one step and reads the common prefix and its own tokens only."""
    pool, pages = _kv_pool()
    prefix = np.arange(1, 10 * D + 1, dtype=np.float32).reshape(10, 1, D)
    pages, pool, ok = _append(pages, pool, {0: prefix})
    assert ok
    pages, pool, ok = _fork(pages, pool, 0, [2, 3])
    assert ok
    table = np.asarray(pool.page_indices)
    assert (table[[2, 3], :2] == table[0, :2]).all(), "the full pages are shared"
    assert len({table[0, 2], table[2, 2], table[3, 2]}) == 3, "the partial page is not"
    np.testing.assert_array_equal(np.asarray(pool.refcount)[table[0, :3]], [3, 3, 1])
    own = {s: np.full((3, 1, D), 100.0 * (s + 1), np.float32) for s in (0, 2, 3)}
    pages, pool, ok = _append(pages, pool, own)
    assert ok
    contents = [np.concatenate([prefix, own[s]]) if s in own else prefix[:0] for s in range(4)]
    _check_readable(pages, pool, contents)


def test_page_aligned_fork_shares_every_page_and_copies_nothing():
    pool = jaxpaged.create_pool(8, 4, 3, 4)
    pool, _ = jaxpaged.reserve(pool, jnp.array([0]), jnp.array([8]))
    pool, ok, copies = jaxpaged.fork(pool, jnp.int32(0), jnp.array([1, 2]))
    assert ok
    np.testing.assert_array_equal(np.asarray(copies), -1)
    table = np.asarray(pool.page_indices)
    np.testing.assert_array_equal(table[1:], table[[0, 0]])
    np.testing.assert_array_equal(np.asarray(pool.refcount)[table[0, :2]], [3, 3])
    # The next token of each goes to a fresh page of its own.
    pool, ok = jaxpaged.reserve(pool, jnp.array([0, 1, 2]), jnp.array([9, 9, 9]))
    assert ok
    assert len(set(np.asarray(pool.page_indices[:, 2]).tolist())) == 3
    assert int(jaxpaged.num_free_pages(pool)) == 3


def test_release_frees_a_shared_page_when_its_last_holder_goes():
    pool = jaxpaged.create_pool(8, 4, 3, 4)
    pool, _ = jaxpaged.reserve(pool, jnp.array([0]), jnp.array([6]))
    pool, ok, _ = jaxpaged.fork(pool, jnp.int32(0), jnp.array([1]))
    assert ok and int(jaxpaged.num_free_pages(pool)) == 5
    shared = int(pool.page_indices[0, 0])
    pool = jaxpaged.release(pool, jnp.array([0, 0]))  # a repeated id releases once
    assert int(pool.refcount[shared]) == 1 and int(jaxpaged.num_free_pages(pool)) == 6
    pool = jaxpaged.release(pool, jnp.array([1]))
    assert np.asarray(pool.free).all()


def test_retained_pages_outlive_their_slot_and_attach_to_new_ones():
    """A prefix cache's life cycle: a slot's full pages are retained (its partly filled last
    page cannot be), outlive the slot, start two new slots, and are free once dropped."""
    pool = jaxpaged.create_pool(8, 4, 3, 4)
    pool, _ = jaxpaged.reserve(pool, jnp.array([0]), jnp.array([10]))
    pages = np.asarray(pool.page_indices[0, :3])
    pool, ok = jaxpaged.retain(pool, jnp.array([pages[2], -1]))
    assert not ok
    pool, ok = jaxpaged.retain(pool, jnp.asarray(pages[:2]))
    assert ok
    pool = jaxpaged.release(pool, jnp.array([0]))
    np.testing.assert_array_equal(np.asarray(pool.refcount)[pages], [1, 1, 0])
    rows = np.full((3, 4), -1, np.int32)
    rows[0, :2], rows[1, :1] = pages[:2], pages[:1]
    pool, ok = jaxpaged.attach(pool, jnp.array([1, 2, -1]), jnp.asarray(rows), jnp.array([8, 4, 0]))
    assert ok
    np.testing.assert_array_equal(np.asarray(pool.refcount)[pages[:2]], [3, 2])
    np.testing.assert_array_equal(np.asarray(pool.kv_lens), [0, 8, 4])
    np.testing.assert_array_equal(np.asarray(pool.num_owned), [0, 2, 1])
    np.testing.assert_array_equal(np.asarray(pool.page_indices[1]), [*pages[:2], -1, -1])
    # Their next tokens go to fresh pages of their own.
    pool, ok = jaxpaged.reserve(pool, jnp.array([1, 2]), jnp.array([9, 5]))
    assert ok and int(pool.page_indices[1, 2]) != int(pool.page_indices[2, 1])
    assert int(jaxpaged.num_free_pages(pool)) == 4
    pool = jaxpaged.release(pool, jnp.array([1, 2]))
    pool, ok = jaxpaged.drop(pool, jnp.asarray(pages[:2]))
    assert ok and np.asarray(pool.free).all()
    before = jax.tree.map(np.array, pool)
    pool, ok = jaxpaged.drop(pool, jnp.asarray(pages[:1]))  # no holder left to drop
    assert not ok
    _assert_unchanged(pool, before)


@pytest.mark.parametrize(
    ("seq_ids", "kv_lens", "why"),
    [
        ([0, -1], [4, 0], "active slot"),
        ([1, 1], [4, 4], "repeated slot"),
        ([3, -1], [4, 0], "slot out of range"),
        ([1, -1], [6, 0], "length not page-aligned"),
        ([1, -1], [8, 0], "second page free"),
    ],
)
def test_bad_attach_is_a_no_op(seq_ids, kv_lens, why):
    pool = jaxpaged.create_pool(8, 4, 3, 4)
    pool, _ = jaxpaged.reserve(pool, jnp.array([0]), jnp.array([6]))
    rows = np.full((2, 4), -1, np.int32)
    rows[:, 0], rows[:, 1] = int(pool.page_indices[0, 0]), 7  # page 7 is free
    before = jax.tree.map(np.array, pool)
    pool, ok = jaxpaged.attach(
        pool, jnp.array(seq_ids), jnp.asarray(rows), jnp.array(kv_lens, jnp.int32)
    )
    assert not ok, why
    _assert_unchanged(pool, before)


def _bad_fork_pool():
    """Slot 0 holds 6 tokens, slot 3 holds 2; slots 1 and 2 are empty."""
    pool = jaxpaged.create_pool(12, 4, 4, 4)
    pool, _ = jaxpaged.reserve(pool, jnp.array([0, 3]), jnp.array([6, 2]))
    return pool


@pytest.mark.parametrize(
    ("src", "dsts", "match"),
    [
        (1, [2, -1], "src slot 1 is inactive"),
        (4, [2, -1], r"src 4 is outside \[0, max_seqs=4\)"),
        (-1, [2, -1], "src -1 is outside"),
        (0, [2, 3], "destination slot 3 is active"),
        (0, [0, -1], "destination 0 is the source"),
        (0, [2, 4], r"destination 4 is outside \[0, max_seqs=4\)"),
        (0, [2, 2], "destination slot 2 appears more than once"),
    ],
)
def test_bad_fork_is_a_no_op_and_validate_fork_names_the_rule(src, dsts, match):
    pool = _bad_fork_pool()
    with pytest.raises(ValueError, match=match):
        jaxpaged.validate_fork(pool, src, dsts)
    before = jax.tree.map(np.array, pool)
    pool, ok, copies = jaxpaged.fork(pool, jnp.int32(src), jnp.array(dsts, jnp.int32))
    assert not ok
    np.testing.assert_array_equal(np.asarray(copies), -1)
    _assert_unchanged(pool, before)


def test_fork_checks_shapes_before_tracing():
    pool = _bad_fork_pool()
    jaxpaged.validate_fork(pool, 0, [1, -1, 2])  # a valid fork passes
    for src, dsts in ((jnp.array([0]), jnp.array([1])), (jnp.int32(0), jnp.array([[1]]))):
        with pytest.raises(ValueError, match="src must be a scalar and dst_seq_ids 1-D"):
            jaxpaged.fork(pool, src, dsts)
        with pytest.raises(ValueError, match="src must be a scalar and dst_seq_ids 1-D"):
            jaxpaged.validate_fork(pool, src, dsts)


def test_exhaustion_is_all_or_nothing():
    pool = jaxpaged.create_pool(4, 4, 3, 4)
    pool, ok = jaxpaged.reserve(pool, jnp.array([0]), jnp.array([9]))  # 3 pages
    assert ok
    pool, ok = jaxpaged.reserve(pool, jnp.array([0, 1]), jnp.array([12, 5]))  # 1 + 2 > 1 free
    assert not ok
    assert int(jaxpaged.num_free_pages(pool)) == 1
    assert int(pool.num_owned[1]) == 0 and int(pool.kv_lens[0]) == 9
    # Two copies of the partial last page do not fit in the one free page: neither happens.
    before = jax.tree.map(np.array, pool)
    pool, ok, copies = jaxpaged.fork(pool, jnp.int32(0), jnp.array([1, 2]))
    assert not ok
    np.testing.assert_array_equal(np.asarray(copies), -1)
    _assert_unchanged(pool, before)
    pool, ok, _ = jaxpaged.fork(pool, jnp.int32(0), jnp.array([1, -1]))
    assert ok and int(jaxpaged.num_free_pages(pool)) == 0


def test_truncate_gives_back_the_pages_past_the_new_end_but_never_a_shared_last_page():
    pool = jaxpaged.create_pool(8, 4, 3, 4)
    pool, _ = jaxpaged.reserve(pool, jnp.array([0]), jnp.array([9]))  # 3 pages
    pool, ok, _ = jaxpaged.fork(pool, jnp.int32(0), jnp.array([1]))  # shares 2, copies 1
    assert ok and int(jaxpaged.num_free_pages(pool)) == 4
    before = jax.tree.map(np.array, pool)
    # Slot 0 ending at 6 tokens would write its next token into page 1, which slot 1 holds.
    pool, ok = jaxpaged.truncate(pool, jnp.array([0]), jnp.array([6]))
    assert not ok
    _assert_unchanged(pool, before)
    # A longer length than the slot holds is refused too: truncate never grows.
    pool, ok = jaxpaged.truncate(pool, jnp.array([1]), jnp.array([10]))
    assert not ok
    _assert_unchanged(pool, before)
    # Both ending inside page 0, which they share, is refused; ending on a page boundary is
    # fine: the next token goes to a fresh page. A repeated slot takes its smaller length.
    pool, ok = jaxpaged.truncate(pool, jnp.array([0, 1]), jnp.array([4, 3]))
    assert not ok
    _assert_unchanged(pool, before)
    pool, ok = jaxpaged.truncate(pool, jnp.array([0, 1, 0]), jnp.array([8, 8, 4]))
    assert ok
    np.testing.assert_array_equal(np.asarray(pool.kv_lens), [4, 8, 0])
    np.testing.assert_array_equal(np.asarray(pool.num_owned), [1, 2, 0])
    # Page 0 is still shared, page 1 now slot 1's alone; slot 0's pages 1-2 and slot 1's copy
    # of the last page went back.
    table = np.asarray(pool.page_indices)
    assert int(pool.refcount[table[0, 0]]) == 2 and int(pool.refcount[table[1, 1]]) == 1
    assert int(jaxpaged.num_free_pages(pool)) == 6
    assert (table[0, 1:] == -1).all() and (table[1, 2:] == -1).all()


def test_batch_metadata_pads_unknown_slots():
    pool = jaxpaged.create_pool(8, 4, 2, 3)
    pool, _ = jaxpaged.reserve(pool, jnp.array([1]), jnp.array([6]))
    kv_lens, table = jaxpaged.batch_metadata(pool, jnp.array([1, -1, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(kv_lens), [6, 0, 0])
    np.testing.assert_array_equal(np.asarray(table[1:]), -1)
    np.testing.assert_array_equal(np.asarray(table[0, :2]), np.asarray(pool.page_indices[1, :2]))


def test_pool_is_donated():
    pool = jaxpaged.create_pool(8, 4, 2, 3)
    args = {
        jaxpaged.reserve: (jnp.array([0]), jnp.array([5])),
        jaxpaged.truncate: (jnp.array([0]), jnp.array([0])),
        jaxpaged.fork: (jnp.int32(0), jnp.array([1])),
        jaxpaged.release: (jnp.array([0]),),
        jaxpaged.attach: (jnp.array([1]), jnp.zeros((1, 3), jnp.int32), jnp.array([4])),
        jaxpaged.retain: (jnp.array([0]),),
        jaxpaged.drop: (jnp.array([0]),),
    }
    for fn, rest in args.items():
        compiled = fn.lower(pool, *rest).compile()
        assert compiled.memory_analysis().alias_size_in_bytes >= sum(
            x.nbytes for x in jax.tree.leaves(pool)
        ), fn.__name__
