"""Shared-prefix (cascade) decode attention: on page tables with real sharing (forked samples,
prefix-cache hits) it gives plain `paged_decode_attention`'s outputs and LSEs for every backend;
`find_prefix_groups` groups only what is safe; `validate_prefix_groups` names each broken rule;
the engine's tokens and logits do not change with it.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpaged
from models.config import CONFIGS, EngineConfig
from models.decoder import Decoder
from models.engine import Engine, PrefixSharing
from models.scheduler import SamplingParams
from pallas_kernels.common import poison_outputs
from tests.helpers import LSE_TOL, OUT_TOL, backend_params, require
from tests.test_engine import (
    SHARED_PARAMS,
    SHARED_PROMPTS,
    _all_samples,
    _assert_same,
    _engine,
    _prompt,
    _run_recording,
    _separate_reference,
)

PAGE = 16
BACKENDS = backend_params(gpu=(("triton", "triton-gpu"), ("mosaic", "mosaic-gpu")))
# Cascade against plain decode of the same backend, both against the same keys:
# - float32: both accumulate in float32; the cascade sums the keys in two parts and merges
#   them (exp of LSE differences, one division), which moves outputs and LSEs by ~1e-6: 1e-5.
# - bfloat16: the cascade's two partial outputs are rounded to bf16 before the merge and the
#   merged one again, and each part rounds its own softmax probabilities: the tolerances of
#   the kernels against the float64 loop (tests/helpers.py). LSEs are float32 throughout.
OUT_ATOL = {jnp.float32: 1e-5, jnp.bfloat16: OUT_TOL[jnp.bfloat16]}
LSE_ATOL = {jnp.float32: 1e-5, jnp.bfloat16: LSE_TOL[jnp.bfloat16]}


def _shared_pool(prompts, attached, lone, *, max_seqs: int, pages_per_seq: int, page_size=PAGE):
    """A pool after a decode step's reservation, its sharing made by the pool's own ops.

    `prompts`: (prompt_len, kv_lens) per prompt: `reserve` the prompt in a slot, `fork` it
    into one more slot per further entry of kv_lens (sharing its full pages, n samples), then
    grow every sample to its kv_len. `attached`: (prompt_len, kv_lens) per prompt: the prompt
    in a slot, then one more slot per further entry `attach`ed to its full pages (prefix-cache
    hits), then grown. `lone`: the kv_lens of sequences that share nothing. The slots after
    them are inactive. Returns the pool and the slots of each prompt's sequences.
    """
    need = sum(-(-n // page_size) for _, lens in prompts + attached for n in lens)
    need += sum(-(-n // page_size) for n in lone)
    pool = jaxpaged.create_pool(need + 4, page_size, max_seqs, pages_per_seq)

    def padded(values, fill=-1):  # to max_seqs entries, so that each pool op compiles once
        return jnp.array(list(values) + [fill] * (max_seqs - len(values)), jnp.int32)

    slots, families, grown = 0, [], []
    for kind, entries in (("fork", prompts), ("attach", attached)):
        for prompt_len, lens in entries:
            family = list(range(slots, slots + len(lens)))
            slots += len(lens)
            pool, ok = jaxpaged.reserve(pool, padded(family[:1]), padded([prompt_len], 0))
            assert ok
            if kind == "fork":
                pool, ok, _ = jaxpaged.fork(pool, jnp.int32(family[0]), padded(family[1:]))
            else:
                rows = jnp.tile(pool.page_indices[family[0]], (max_seqs, 1))
                full = prompt_len // page_size * page_size
                pool, ok = jaxpaged.attach(
                    pool, padded(family[1:]), rows, padded([full] * (len(family) - 1), 0)
                )
            assert ok
            families.append(family)
            grown += list(zip(family, lens, strict=True))
    grown += [(slots + i, n) for i, n in enumerate(lone)]
    ids, lens = zip(*grown, strict=True)
    pool, ok = jaxpaged.reserve(pool, padded(ids), padded(lens, 0))
    assert ok
    return pool, families


# Prompt A (40 tokens: 2 full pages and 8 tokens) as 5 samples: one grown to 48 (its new token
# is the last of a page, which thus stays private), the others past it. Prompt B (70 tokens) as
# 2 samples sharing 4 pages. Prompt C (33 tokens) with one slot attached to its 2 full pages
# and grown to 33 (its new token is its suffix's only key). A lone sequence, 2 inactive slots.
CPU_POOL = dict(
    prompts=[(40, [48, 41, 60, 75, 57]), (70, [71, 80])],
    attached=[(33, [34, 33])],
    lone=[21],
    max_seqs=13,
    pages_per_seq=6,
)


def _pages(pool, shape, dtype, rng):
    """K and V pages: random where a sequence holds a position below its kv_len, NaN in every
    other slot (free pages, slots past kv_len) so that a stray read shows."""
    table, lens = np.asarray(pool.page_indices), np.asarray(pool.kv_lens)
    live = np.zeros(shape[:2], bool)
    for s, n in enumerate(lens):
        pos = np.arange(n)
        live[table[s, pos // shape[1]], pos % shape[1]] = True
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    k[~live], v[~live] = np.nan, np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _decode(backend, q, k, v, pool, groups, **options):
    args = (q, k, v, pool.kv_lens, pool.page_indices, groups)
    with poison_outputs(), jaxpaged.quiet_triton_deprecation():
        return jaxpaged.shared_prefix_decode_attention(
            *args, return_lse=True, implementation=backend, **options
        )


def _assert_equal_to_plain(plain, cascade, dtype):
    for got, want, tol in zip(cascade, plain, (OUT_ATOL[dtype], LSE_ATOL[dtype]), strict=True):
        got, want = (np.asarray(x.astype(jnp.float32)) for x in (got, want))
        assert not np.isnan(got).any() and not np.isnan(want).any(), "NaN"
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), "empty rows differ"
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=tol)


def _groups(pool, size):
    return jaxpaged.find_prefix_groups(
        pool.page_indices, pool.kv_lens, PAGE, max_group_size=size, min_saved_tokens=1
    )


CASES = [  # (Hq, Hkv, max_group_size, dtype, prefix_num_splits: the XLA reference ignores it)
    pytest.param(4, 2, 2, jnp.float32, None, id="gqa-n2-f32"),
    pytest.param(4, 1, 8, jnp.bfloat16, 3, id="mqa-n8-bf16-splits3"),
]
# CPU_POOL's groups: prompt A's 5 samples in chunks of 2, 2 and 1 (a group of one is none) at
# n=2, in one group at n=8; prompt B's 2 samples (4 pages); prompt C and its hit (2 pages).
GROUPS = {2: ({0: 2, 2: 2, 5: 4, 7: 2}, [0, 0, 2, 2, -1]), 8: ({0: 2, 5: 4, 7: 2}, [0] * 5)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "size", "dtype", "splits"), CASES)
def test_cascade_equals_plain_decode(backend, num_q_heads, num_kv_heads, size, dtype, splits):
    """On the pool's sharing, in groups of at most `size` members, the shared-prefix path
    gives the outputs and LSEs of the plain path (`use` False: one `paged_decode_attention`
    call, traced in the same function); so does it with every group emptied (every prefix
    empty, LSE -inf)."""
    require(backend, ("decode",), dtype)
    pool, families = _shared_pool(**CPU_POOL)
    rng = np.random.default_rng(size)
    k, v = _pages(pool, (pool.num_pages, PAGE, num_kv_heads, 64), dtype, rng)
    q = jnp.asarray(rng.standard_normal((pool.max_seqs, num_q_heads, 64)), dtype)
    groups = _groups(pool, size)
    jaxpaged.validate_prefix_groups(groups, pool.page_indices, pool.kv_lens, PAGE)
    shared, group_of = GROUPS[size]
    assert bool(groups.use)
    assert dict(enumerate(np.asarray(groups.shared_pages))) == {
        g: shared.get(g, 0) for g in range(pool.max_seqs)
    }
    assert np.asarray(groups.group_of)[families[0]].tolist() == group_of
    decode = functools.partial(_decode, backend, q, k, v, pool, prefix_num_splits=splits)
    plain = decode(dataclasses.replace(groups, use=jnp.bool_(False)))
    cascade = decode(groups)
    _assert_equal_to_plain(plain, cascade, dtype)
    # Planned once (as the engine does per step), the same numbers to the bit.
    plan = jaxpaged.plan_cascade(groups, pool.page_indices, pool.kv_lens, PAGE)
    for got, want in zip(decode(plan), cascade, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # One group slot (`max_groups`): the first group reads its prefix once, the others all
    # their pages in the suffix call, as sequences that share nothing.
    one = jaxpaged.plan_cascade(groups, pool.page_indices, pool.kv_lens, PAGE, max_groups=1)
    assert one.prefix_members.shape[0] == 1
    assert 0 < int(np.sum(one.mine)) < int(np.sum(plan.mine))
    _assert_equal_to_plain(plain, decode(one), dtype)
    empty = dataclasses.replace(
        groups,
        members=jnp.full_like(groups.members, -1),
        shared_pages=jnp.zeros_like(groups.shared_pages),
        group_of=jnp.full_like(groups.group_of, -1),
        rank_of=jnp.full_like(groups.rank_of, -1),
    )
    _assert_equal_to_plain(plain, decode(empty), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cascade_beyond_its_packed_group_slots_reads_the_rest_as_suffix(backend):
    """The prefix call packs the nonempty groups into S / 2 slots (a valid descriptor has no
    more). A hand-built one with a "group" of one member per active slot, each sharing its
    own shareable pages, has 11 of them for 6 slots: the groups packed past the last slot have
    no prefix, their members attend all their pages in the suffix call, and every output
    still equals plain decode's."""
    dtype = jnp.float32
    require(backend, ("decode",), dtype)
    pool, _ = _shared_pool(**CPU_POOL)
    rng = np.random.default_rng(7)
    k, v = _pages(pool, (pool.num_pages, PAGE, 2, 64), dtype, rng)
    q = jnp.asarray(rng.standard_normal((pool.max_seqs, 4, 64)), dtype)
    lens = np.asarray(pool.kv_lens)
    slots = np.arange(pool.max_seqs, dtype=np.int32)
    shareable = np.where(lens > 0, (lens - 1) // PAGE, 0).astype(np.int32)
    alone = shareable > 0
    assert alone.sum() > pool.max_seqs // 2
    members = np.full((pool.max_seqs, 2), -1, np.int32)
    members[alone, 0] = slots[alone]
    groups = jaxpaged.PrefixGroups(
        members=jnp.asarray(members),
        shared_pages=jnp.asarray(np.where(alone, shareable, 0)),
        group_of=jnp.asarray(np.where(alone, slots, -1)),
        rank_of=jnp.asarray(np.where(alone, 0, -1).astype(np.int32)),
        use=jnp.bool_(True),
    )
    decode = functools.partial(_decode, backend, q, k, v, pool)
    plain = decode(dataclasses.replace(groups, use=jnp.bool_(False)))
    _assert_equal_to_plain(plain, decode(groups), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [8, 16])
@pytest.mark.parametrize("splits", [None, 4])
def test_mosaic_cascade_equals_plain_decode_at_the_benchmark_shape(size, splits):
    """Hq=32, Hkv=8, D=128, bf16: 8 samples of a 1000-token prompt in one group, 3 samples of
    another, a prefix-cache hit, lone sequences. The prefix call has 32 query rows per KV head
    at 8 members, the whole 64-row tile at 16 (the members past 8 are padding)."""
    require("mosaic", ("decode",), jnp.bfloat16)
    pool, families = _shared_pool(
        prompts=[(1000, [1001 + 37 * i for i in range(8)]), (517, [520, 600, 1500])],
        attached=[(800, [900, 801])],
        lone=[1, 300, 2048],
        max_seqs=24,
        pages_per_seq=128,
    )
    rng = np.random.default_rng(size)
    k, v = _pages(pool, (pool.num_pages, PAGE, 8, 128), jnp.bfloat16, rng)
    q = jnp.asarray(rng.standard_normal((pool.max_seqs, 32, 128)), jnp.bfloat16)
    groups = jaxpaged.find_prefix_groups(
        pool.page_indices, pool.kv_lens, PAGE, max_group_size=size, min_saved_tokens=1
    )
    assert np.asarray(groups.group_of)[families[0]].tolist() == [0] * 8
    args = (q, k, v, pool.kv_lens, pool.page_indices)
    plain = jaxpaged.paged_decode_attention(*args, return_lse=True, implementation="mosaic")
    cascade = _decode("mosaic", q, k, v, pool, groups, prefix_num_splits=splits)
    _assert_equal_to_plain(plain, cascade, jnp.bfloat16)


@pytest.mark.gpu
def test_mosaic_rejects_groups_beyond_its_tile():
    pool, _ = _shared_pool(**CPU_POOL)
    groups = jaxpaged.find_prefix_groups(pool.page_indices, pool.kv_lens, PAGE, max_group_size=17)
    q = jnp.ones((pool.max_seqs, 32, 128), jnp.bfloat16)
    k = jnp.ones((pool.num_pages, PAGE, 8, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="takes groups of at most 16 members"):
        jaxpaged.shared_prefix_decode_attention(
            q, k, k, pool.kv_lens, pool.page_indices, groups, implementation="mosaic"
        )


@pytest.mark.parametrize(
    ("heads", "size"),
    [((4, 2), 32), ((32, 8), 16), ((16, 8), 32), ((4, 1), 16), ((24, 8), 20), ((64, 1), 1)],
)
def test_default_max_group_size_fills_one_mosaic_tile(heads, size):
    assert jaxpaged.default_max_group_size(*heads) == size


@st.composite
def _tables(draw):
    """A decode step's page table over CPU_POOL's 13 slots of 6 pages: each sequence starts with
    some pages of one of three prompts (so page 0 repeats, followed by pages that may or may not
    agree) and continues on pages of its own; random kv_lens, inactive slots, -1 past a
    sequence's pages. Unlike a pool's, a shared page may be a sequence's partly filled last
    page: the groups must still keep it out of the shared part."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_seq_slots, pages_per_seq = CPU_POOL["max_seqs"], CPU_POOL["pages_per_seq"]
    prompts = rng.permutation(100)[: 3 * pages_per_seq].reshape(3, pages_per_seq)
    table = np.full((num_seq_slots, pages_per_seq), -1, np.int32)
    kv_lens = np.zeros(num_seq_slots, np.int32)
    private = iter(range(100, 200))
    for s in range(num_seq_slots):
        if rng.random() < 0.15:
            continue  # inactive
        kv_lens[s] = rng.integers(1, pages_per_seq * PAGE + 1)
        owned = -(-kv_lens[s] // PAGE)
        common = rng.integers(0, owned + 1)
        table[s, :common] = prompts[rng.integers(0, 3), :common]
        table[s, common:owned] = [next(private) for _ in range(owned - common)]
    return table, kv_lens


@settings(max_examples=30, deadline=None)
@given(_tables(), st.sampled_from([(2, 1), (8, 1), (3, 64)]))
def test_found_groups_share_only_full_pages_below_every_new_token(case, options):
    """Every group passes `validate_prefix_groups` (members distinct and active, holding
    member 0's shared pages, which lie below their new tokens), has 2 to `size` members and
    shares the longest such run; a class of at most `size` sequences with the same page 0 is
    one group; `use` says whether the tokens not read reach the threshold."""
    (table, kv_lens), (size, min_tokens) = case, options
    groups = jaxpaged.find_prefix_groups(
        jnp.asarray(table),
        jnp.asarray(kv_lens),
        PAGE,
        max_group_size=size,
        min_saved_tokens=min_tokens,
    )
    jaxpaged.validate_prefix_groups(groups, table, kv_lens, PAGE)
    members, shared = np.asarray(groups.members), np.asarray(groups.shared_pages)
    shareable = np.clip((kv_lens - 1) // PAGE, 0, None)
    saved = 0
    for g in np.flatnonzero(shared):
        group = members[g][members[g] >= 0]
        assert 2 <= len(group) <= size and group[0] == g
        common = [np.argmin(np.append(table[s] == table[g], False)) for s in group]
        assert shared[g] == min(np.minimum(shareable[group], common))
        saved += (len(group) - 1) * shared[g] * PAGE
    eligible = (kv_lens > 0) & (shareable > 0)
    for first in np.unique(table[eligible, 0]):
        same = np.flatnonzero(eligible & (table[:, 0] == first))
        if 2 <= len(same) <= size:
            assert (np.asarray(groups.group_of)[same] == same[0]).all()
    assert bool(groups.use) == (saved >= min_tokens)


def _valid():
    pool, _ = _shared_pool(**CPU_POOL)
    fields = {k: np.array(v) for k, v in vars(_groups(pool, 2)).items()}
    return fields, np.array(pool.page_indices), np.array(pool.kv_lens)


# Edits of CPU_POOL's groups at n=2 ({0, 1} and {2, 3} share 2 pages, {5, 6} 4, {7, 8} 2;
# slot 4 and 9 are alone, 10-12 inactive) or of its page table, and the rule each breaks.
BAD = [
    ("members are slots packed from column 0", {"members": {2: [-1, 2]}}),
    (r"members\[2, 1\] = 13 is outside \[0, S=13\)", {"members": {2: [2, 13]}}),
    ("slot 5 is in two groups", {"members": {2: [2, 5]}}),
    (r"group_of\[9\], rank_of\[9\] = 0, -1", {"group_of": {9: 0}}),
    (r"group_of\[1\], rank_of\[1\] = 0, 0", {"rank_of": {1: 0}}),
    (r"shared_pages\[5\] = 7 is outside \[0, pages_per_seq=6\]", {"shared_pages": {5: 7}}),
    ("group 2 has 2 members and shared_pages 0", {"shared_pages": {2: 0}}),
    ("group 9 has 0 members and shared_pages 1", {"shared_pages": {9: 1}}),
    ("shares 3 pages .* member 0 has kv_len 48", {"shared_pages": {0: 3}}),
    ("member 3 of group 2 does not hold", {"table": {(3, 1): 99}}),
    (
        "slot 11 of group 4 is inactive",
        {
            "members": {4: [4, 11]},
            "shared_pages": {4: 2},
            "group_of": {4: 4, 11: 4},
            "rank_of": {4: 0, 11: 1},
        },
    ),
]


@pytest.mark.parametrize(("match", "edits"), BAD, ids=[m for m, _ in BAD])
def test_validate_names_the_broken_rule(match, edits):
    fields, table, kv_lens = _valid()
    jaxpaged.validate_prefix_groups(jaxpaged.PrefixGroups(**fields), table, kv_lens, PAGE)
    for name, changes in edits.items():
        array = table if name == "table" else fields[name]
        for index, value in changes.items():
            array[index] = value
    with pytest.raises(ValueError, match=match):
        jaxpaged.validate_prefix_groups(jaxpaged.PrefixGroups(**fields), table, kv_lens, PAGE)


def test_bad_arguments_raise_before_tracing():
    fields, table, kv_lens = _valid()
    pool = (jnp.ones((4, PAGE, 2, 64)),) * 2
    q = jnp.ones((13, 4, 64))
    args = (q, *pool, jnp.asarray(kv_lens), jnp.asarray(table))
    op = jaxpaged.shared_prefix_decode_attention
    with pytest.raises(ValueError, match="takes no sliding_window"):
        op(*args, jaxpaged.PrefixGroups(**fields), sliding_window=8)
    with pytest.raises(TypeError, match="PrefixGroups.members must be an int32"):
        op(*args, jaxpaged.PrefixGroups(**{**fields, "members": fields["members"].astype(float)}))
    with pytest.raises(ValueError, match="PrefixGroups.use must be a bool scalar"):
        op(*args, jaxpaged.PrefixGroups(**{**fields, "use": np.ones(2, bool)}))
    with pytest.raises(ValueError, match="one per sequence slot"):
        op(*args, jaxpaged.PrefixGroups(**{**fields, "group_of": fields["group_of"][:5]}))
    with pytest.raises(TypeError, match="groups must be a PrefixGroups"):
        op(*args, fields)
    with pytest.raises(ValueError, match="prefix_num_splits must be None or an int >= 1"):
        op(*args, jaxpaged.PrefixGroups(**fields), prefix_num_splits=0)
    with pytest.raises(ValueError, match="max_group_size must be an int >= 1"):
        jaxpaged.find_prefix_groups(args[4], args[3], PAGE, max_group_size=0)
    groups = jaxpaged.PrefixGroups(**fields)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        jaxpaged.plan_cascade(groups, args[4], args[3], 0)
    with pytest.raises(ValueError, match="max_groups must be None or an int >= 1"):
        jaxpaged.plan_cascade(groups, args[4], args[3], PAGE, max_groups=0)
    plan = jaxpaged.plan_cascade(groups, args[4], args[3], PAGE)
    bad = dataclasses.replace(plan, suffix_table=plan.suffix_table[:, :1])
    with pytest.raises(ValueError, match=r"CascadePlan.suffix_table must be int32\[13, "):
        op(*args, bad)
    with pytest.raises(ValueError, match=r"CascadePlan.mine must be bool\[13\]"):
        op(*args, dataclasses.replace(plan, mine=plan.back_rank))


# The engine: forced onto the shared-prefix path whenever a group exists (one saved token),
# in groups of at most 2 (prompts of 3 samples split).
SHARING = dict(shared_prefix_min_tokens=1, max_prefix_group=2)


@pytest.mark.parametrize("decode_steps", [None, 8], ids=["steps", "blocks"])
def test_engine_outputs_equal_those_without_shared_prefix_attention(decode_steps):
    """n-sample requests and prefix-cache hits running beside the requests whose pages they
    hit: the same tokens, log-probabilities within 1e-5 and (steps) float32 output logits within
    1e-5 as the samples give as separate requests, which share no page."""
    record = decode_steps is None
    engine = _engine("xla", decode_steps=decode_steps, prefix_caching=True, **SHARING)
    with jaxpaged.quiet_triton_deprecation():
        seqs = engine.generate(SHARED_PROMPTS, SHARED_PARAMS[True], record_prompt_logits=record)
    forked_steps = engine.stats.shared_prefix_steps
    assert forked_steps > 0 and engine.stats.forked_samples > 0
    samples, refs = _all_samples(seqs), _separate_reference("xla", True)
    _assert_same(samples, refs)
    if record:
        for seq, ref in zip(samples, refs, strict=True):
            np.testing.assert_allclose(seq.output_logits, ref.output_logits, rtol=0, atol=1e-5)

    # One group slot a step: the other groups read their prefixes as private pages.
    one_slot = _engine("xla", decode_steps=decode_steps, max_prefix_groups=1, **SHARING)
    with jaxpaged.quiet_triton_deprecation():
        seqs = one_slot.generate(SHARED_PROMPTS, SHARED_PARAMS[True])
    assert one_slot.stats.shared_prefix_steps > 0
    _assert_same(_all_samples(seqs), refs)

    # Prefix-cache hits: two requests start on a running request's first two pages.
    base = _prompt(45, 71)
    prompts = [base, base[:40] + _prompt(3, 72), base[:33] + _prompt(9, 73)]
    # The first request runs long enough to decode beside the others, after the blocks that
    # are in flight when they arrive.
    params = [SamplingParams(40), SamplingParams(10, 0.9, seed=8), SamplingParams(12)]
    hit_pages = engine.stats.prefix_hit_pages
    first = engine.add_request(prompts[0], params[0])
    with jaxpaged.quiet_triton_deprecation():
        while len(first.output) < 2:
            engine.step(record_prompt_logits=record)
        hits = [engine.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:], strict=True)]
        while engine.has_work():
            engine.step(record_prompt_logits=record)
    assert engine.stats.prefix_hit_pages - hit_pages == 4
    assert engine.stats.shared_prefix_steps > forked_steps
    refs = _run_recording(_engine("xla", decode_steps=None), prompts, params)
    _assert_same([first, *hits], refs)
    if record:
        for seq, ref in zip([first, *hits], refs, strict=True):
            np.testing.assert_allclose(seq.output_logits, ref.output_logits, rtol=0, atol=1e-5)


def test_engine_takes_the_shared_prefix_path_only_where_it_can_pay():
    """Plain decode (nothing of the shared-prefix path compiled) when it is off, under a sliding
    window, or when no step of the config can save `shared_prefix_min_tokens` (the tests'
    small configs); groups as large as the backends take for the model otherwise."""
    assert _engine("xla").prefix_sharing is None  # at most 3 * 9 pages saved: below 4096
    assert _engine("xla", **SHARING).prefix_sharing == PrefixSharing(2, 1)
    one_group = _engine("xla", max_prefix_groups=1, **SHARING).prefix_sharing
    assert one_group == PrefixSharing(2, 1, max_groups=1)
    assert _engine("xla", shared_prefix_min_tokens=1).prefix_sharing == PrefixSharing(32, 1)
    off = dict(SHARING, shared_prefix_attention=False)
    assert _engine("xla", **off).prefix_sharing is None
    windowed = Decoder(dataclasses.replace(CONFIGS["tiny"], sliding_window=8), rngs=nnx.Rngs(0))
    config = EngineConfig(num_pages=40, max_seqs=4, max_model_len=160, **SHARING)
    assert Engine(windowed, config).prefix_sharing is None
    with pytest.raises(ValueError, match="shared_prefix_min_tokens must be >= 0"):
        EngineConfig(shared_prefix_min_tokens=-1)
    with pytest.raises(ValueError, match="max_prefix_group must be None or >= 2"):
        EngineConfig(max_prefix_group=1)
    with pytest.raises(ValueError, match="max_prefix_groups must be None or >= 1"):
        EngineConfig(max_prefix_groups=0)


def test_engine_takes_the_shared_prefix_path_only_while_sequences_share_pages():
    """Decode blocks of requests that share no page run the plain block (no group search, no
    conditional per layer); n-sample requests run the shared-prefix block."""
    engine = _engine("xla", decode_steps=8, prefix_caching=True, **SHARING)
    calls = {False: 0, True: 0}

    def counted(shared, fn):
        def call(*args, **kwargs):
            calls[shared] += 1
            return fn(*args, **kwargs)

        return call

    engine._block_fns = {k: counted(k, fn) for k, fn in engine._block_fns.items()}
    alone = SamplingParams(12, 0.9, seed=3)
    with jaxpaged.quiet_triton_deprecation():
        engine.generate([_prompt(21, 80), _prompt(30, 81)], alone)
        assert calls[False] > 0 and calls[True] == 0
        seqs = engine.generate(SHARED_PROMPTS, SHARED_PARAMS[True])
    assert calls[True] > 0 and engine.stats.shared_prefix_steps > 0
    _assert_same(_all_samples(seqs), _separate_reference("xla", True))
