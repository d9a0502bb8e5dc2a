import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged
from tests.helpers import make_batch


def _expected(batch, k_new, v_new, page_indices):
    """Float64-free numpy loop: the pages after writing every live token at its slot."""
    k = np.array(batch.k_pages)
    v = np.array(batch.v_pages)
    page_size = k.shape[1]
    cu = np.asarray(batch.cu_q_lens)
    kv_lens = np.asarray(batch.kv_lens)
    for s in range(int(batch.num_seqs)):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            pos = kv_lens[s] - q_len + i
            page = page_indices[s, pos // page_size]
            k[page, pos % page_size] = np.asarray(k_new[cu[s] + i])
            v[page, pos % page_size] = np.asarray(v_new[cu[s] + i])
    return k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size", [4, 16])
def test_append_writes_exactly_the_new_slots(dtype, page_size):
    rng = np.random.default_rng(page_size)
    seqs = [(1, 9), (6, 6), (0, 5), (5, 13), (page_size, 2 * page_size), (0, 0)]
    batch = make_batch(rng, seqs, page_size=page_size, dtype=dtype, pad_tokens=4, pad_seqs=2)
    num_tokens = batch.q.shape[0]
    k_new = jnp.asarray(rng.standard_normal((num_tokens, 2, 64)), dtype)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, 2, 64)), dtype)
    want_k, want_v = _expected(batch, k_new, v_new, np.asarray(batch.page_indices))
    k, v = jaxpaged.append_kv(
        batch.k_pages,
        batch.v_pages,
        k_new,
        v_new,
        batch.kv_lens,
        batch.page_indices,
        batch.cu_q_lens,
        batch.num_seqs,
    )
    # Bit for bit, so that untouched NaN slots must stay exactly as they were.
    np.testing.assert_array_equal(_bits(k), _bits(want_k))
    np.testing.assert_array_equal(_bits(v), _bits(want_v))


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def test_append_drops_writes_outside_the_pool_or_table():
    rng = np.random.default_rng(0)
    batch = make_batch(rng, [(3, 7), (2, 2)], page_size=4, pad_tokens=0, pad_seqs=0)
    k_new = jnp.asarray(rng.standard_normal((5, 2, 64)), jnp.float32)
    table = np.asarray(batch.page_indices).copy()
    table[0, 1] = batch.k_pages.shape[0] + 5  # out of the pool: positions 4..6 of sequence 0
    table[1, 0] = -1  # negative: all of sequence 1
    before = _bits(batch.k_pages)
    k, _ = jaxpaged.append_kv(
        batch.k_pages,
        batch.v_pages,
        k_new,
        k_new,
        batch.kv_lens,
        jnp.asarray(table),
        batch.cu_q_lens,
        batch.num_seqs,
    )
    # Sequence 0 writes positions 4..6 (its second page, now outside the pool) and sequence 1
    # positions 0..1 (page -1): nothing may land anywhere.
    np.testing.assert_array_equal(_bits(k), before)


@pytest.mark.parametrize("bad_table", [False, True])
def test_slots_then_write_equals_append(bad_table):
    """`kv_slots` once and `write_kv` per layer (the model's steps) write what `append_kv`
    writes, bit for bit, including the writes it drops."""
    rng = np.random.default_rng(2)
    seqs = [(1, 9), (6, 6), (0, 5), (5, 13), (0, 0)]
    batch = make_batch(rng, seqs, page_size=4, pad_tokens=3, pad_seqs=1)
    table = np.asarray(batch.page_indices).copy()
    if bad_table:
        table[0, 2] = batch.k_pages.shape[0] + 1
        table[3, 0] = -1
    table = jnp.asarray(table)
    num_tokens = batch.q.shape[0]
    k_new = jnp.asarray(rng.standard_normal((num_tokens, 2, 64)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, 2, 64)), jnp.float32)
    meta = (batch.kv_lens, table, batch.cu_q_lens, batch.num_seqs)
    want = jaxpaged.append_kv(jnp.copy(batch.k_pages), jnp.copy(batch.v_pages), k_new, v_new, *meta)
    slots = jaxpaged.kv_slots(
        *meta, num_tokens=num_tokens, num_pages=batch.k_pages.shape[0], page_size=4
    )
    got = jaxpaged.write_kv(batch.k_pages, batch.v_pages, k_new, v_new, slots)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    live = np.asarray(slots)[np.asarray(slots) >= 0]
    assert len(set(live.tolist())) == len(live)  # distinct: the scatter's unique indices hold
    step = jaxpaged.StepMetadata.build(
        *meta, num_tokens=num_tokens, pool_shape=batch.k_pages.shape[:2]
    )
    np.testing.assert_array_equal(step.kv_slots, slots)


def test_write_kv_checks_slots():
    pages = jnp.zeros((2, 4, 1, 8), jnp.float32)
    new = jnp.ones((3, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="slots must be i32"):
        jaxpaged.write_kv(pages, pages, new, new, jnp.zeros((2,), jnp.int32))


def test_append_updates_donated_pages_in_place():
    rng = np.random.default_rng(1)
    batch = make_batch(rng, [(2, 5)], page_size=4, pad_tokens=0, pad_seqs=0)
    k_new = jnp.asarray(rng.standard_normal((2, 2, 64)), jnp.float32)
    args = (k_new, k_new, batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
    compiled = jaxpaged.append_kv.lower(batch.k_pages, batch.v_pages, *args).compile()
    pages = batch.k_pages.nbytes + batch.v_pages.nbytes
    assert compiled.memory_analysis().alias_size_in_bytes == pages
    k_pages = batch.k_pages
    jaxpaged.append_kv(k_pages, batch.v_pages, *args)
    assert k_pages.is_deleted()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_copy_pages_copies_whole_pages_and_skips_bad_ids(dtype):
    rng = np.random.default_rng(2)
    k = rng.standard_normal((8, 4, 2, 16))
    k[3, 2:] = np.nan  # a page's unused tail: copied as it is
    k_pages, v_pages = jnp.asarray(k, dtype), jnp.asarray(-k, dtype)
    # Page 0 is read by one copy and written by another: the copy reads it as it was. Pairs with
    # an id outside [0, 8) copy nothing.
    src = jnp.array([3, 0, 5, -1, 9, 2], jnp.int32)
    dst = jnp.array([6, 4, 0, 1, 2, -1], jnp.int32)
    want_k, want_v = np.array(k_pages), np.array(v_pages)
    for s, d in ((3, 6), (0, 4), (5, 0)):
        want_k[d], want_v[d] = np.asarray(k_pages[s]), np.asarray(v_pages[s])
    k_out, v_out = jaxpaged.copy_pages(k_pages, v_pages, src, dst)
    np.testing.assert_array_equal(_bits(k_out), _bits(want_k))
    np.testing.assert_array_equal(_bits(v_out), _bits(want_v))


def test_copy_pages_updates_donated_pages_in_place():
    k_pages = jnp.asarray(np.random.default_rng(3).standard_normal((8, 4, 2, 16)), jnp.float32)
    v_pages = -k_pages
    src, dst = jnp.array([1, -1]), jnp.array([2, -1])
    hlo = jaxpaged.copy_pages.lower(k_pages, v_pages, src, dst).compile().as_text()
    assert "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }" in hlo
    jaxpaged.copy_pages(k_pages, v_pages, src, dst)
    assert k_pages.is_deleted() and v_pages.is_deleted()


def test_copy_pages_checks_shapes_before_tracing():
    pages = jnp.zeros((8, 4, 2, 16))
    with pytest.raises(ValueError, match="src_pages and dst_pages must be i32"):
        jaxpaged.copy_pages(pages, pages + 0, jnp.array([1, 2]), jnp.array([3]))
    with pytest.raises(ValueError, match="k_pages and v_pages must have one shape"):
        jaxpaged.copy_pages(pages, jnp.zeros((8, 4, 2, 8)), jnp.array([1]), jnp.array([3]))
