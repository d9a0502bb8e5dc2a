"""Property tests of the page pool against a plain Python model of page ownership."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpaged

NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ = 12, 4, 4, 5
CAPACITY = PAGE_SIZE * PAGES_PER_SEQ
N = 3  # requests per call: fixed so the jitted functions compile once

seq_id = st.integers(-1, MAX_SEQS)  # -1 is padding, MAX_SEQS is out of range
reserve_op = st.tuples(
    st.just("reserve"),
    st.lists(seq_id, min_size=N, max_size=N),
    st.lists(st.integers(0, CAPACITY + 2), min_size=N, max_size=N),
)
release_op = st.tuples(st.just("release"), st.lists(seq_id, min_size=N, max_size=N))


def _check_invariants(pool, lens):
    free = np.asarray(pool.free)
    table = np.asarray(pool.page_indices)
    owned = np.asarray(pool.num_owned)
    np.testing.assert_array_equal(np.asarray(pool.kv_lens), lens)
    np.testing.assert_array_equal(owned, -(-lens // PAGE_SIZE))
    pages = np.concatenate([table[s, : owned[s]] for s in range(MAX_SEQS)])
    assert len(set(pages.tolist())) == len(pages), "a page is owned twice"
    assert not free[pages].any(), "an owned page is marked free"
    assert free.sum() + len(pages) == NUM_PAGES, "a page was lost"
    for s in range(MAX_SEQS):
        assert (table[s, owned[s] :] == -1).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(reserve_op, release_op), min_size=1, max_size=12))
def test_pool_matches_model(ops):
    pool = jaxpaged.create_pool(NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ)
    lens = np.zeros(MAX_SEQS, np.int64)
    for op in ops:
        if op[0] == "reserve":
            _, ids, new_lens = op
            want = lens.copy()
            valid = True
            for s, n in zip(ids, new_lens, strict=True):
                if s < 0:
                    continue
                valid &= s < MAX_SEQS and n <= CAPACITY
                if s < MAX_SEQS:
                    want[s] = max(want[s], n)
            need = (-(-want // PAGE_SIZE) - -(-lens // PAGE_SIZE)).sum()
            free_before = int(jaxpaged.num_free_pages(pool))
            before = [np.asarray(x) for x in (pool.free, pool.page_indices)]
            pool, ok = jaxpaged.reserve(
                pool, jnp.array(ids, jnp.int32), jnp.array(new_lens, jnp.int32)
            )
            assert bool(ok) == (valid and need <= free_before)
            if ok:
                lens = want
            else:
                # A refused reservation changes nothing.
                np.testing.assert_array_equal(np.asarray(pool.free), before[0])
                np.testing.assert_array_equal(np.asarray(pool.page_indices), before[1])
        else:
            _, ids = op
            free_before = int(jaxpaged.num_free_pages(pool))
            gone = {s for s in ids if 0 <= s < MAX_SEQS}
            returned = sum(-(-int(lens[s]) // PAGE_SIZE) for s in gone)
            pool = jaxpaged.release(pool, jnp.array(ids, jnp.int32))
            assert int(jaxpaged.num_free_pages(pool)) == free_before + returned
            for s in gone:
                lens[s] = 0
        _check_invariants(pool, lens)


def test_exhaustion_is_all_or_nothing():
    pool = jaxpaged.create_pool(4, 4, 2, 4)
    pool, ok = jaxpaged.reserve(pool, jnp.array([0]), jnp.array([9]))  # 3 pages
    assert ok
    pool, ok = jaxpaged.reserve(pool, jnp.array([0, 1]), jnp.array([12, 5]))  # 1 + 2 > 1 free
    assert not ok
    assert int(jaxpaged.num_free_pages(pool)) == 1
    assert int(pool.num_owned[1]) == 0 and int(pool.kv_lens[0]) == 9


def test_batch_metadata_pads_unknown_slots():
    pool = jaxpaged.create_pool(8, 4, 2, 3)
    pool, _ = jaxpaged.reserve(pool, jnp.array([1]), jnp.array([6]))
    kv_lens, table = jaxpaged.batch_metadata(pool, jnp.array([1, -1, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(kv_lens), [6, 0, 0])
    np.testing.assert_array_equal(np.asarray(table[1:]), -1)
    np.testing.assert_array_equal(np.asarray(table[0, :2]), np.asarray(pool.page_indices[1, :2]))


def test_pool_is_donated():
    pool = jaxpaged.create_pool(8, 4, 2, 3)
    compiled = jaxpaged.reserve.lower(pool, jnp.array([0]), jnp.array([5])).compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= sum(
        x.nbytes for x in jax.tree.leaves(pool)
    )
