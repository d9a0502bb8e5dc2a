"""The engine's decode blocks: up to N decode steps in one jitted while loop give what decode
steps one at a time give, whatever N, the batch, the stop tokens and the pool's size.

The per-step engine (`decode_steps=None`) is the reference. Float32 runs of the seeded random
decoder: the block's steps compute the same per-token math as single steps (the same decode
op, the same projections), so the chosen tokens' log-probabilities agree within 1e-5 (they
differ only where XLA fuses the loop body differently) and greedy tokens are identical.
"""

import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged
from models.config import CONFIGS, EngineConfig
from models.engine import (
    BLOCK_LAUNCH_LEAD_S,
    LARGE_STEP_XLA_OPTIONS,
    SMALL_STEP_XLA_OPTIONS,
    Engine,
    Packed,
    StepInputs,
    _decode_metadata,
    block_inputs_after_step,
    block_steps,
    fork_samples,
    step_function,
    uses_command_buffers,
)
from models.prefix_cache import page_keys
from models.sampling import SamplingArrays
from models.scheduler import SamplingParams
from tests.helpers import backend_params, count_compilations, require
from tests.test_model import PAGE, _cached_kv, _check_pool, _model

LOGPROB_TOL = 1e-5
CONFIG = EngineConfig(
    page_size=PAGE, num_pages=40, max_seqs=4, max_tokens_per_step=64, max_model_len=160
)
VOCAB = CONFIGS["tiny"].vocab_size


# Triton in interpret mode is too slow for whole generations on a CPU: GPU only here.
BACKENDS = backend_params(cpu=("xla",))


def _engine(backend, **changes) -> Engine:
    overlap = changes.pop("overlap", True)
    xla_options = changes.pop("xla_options", None)
    return Engine(
        _model(jnp.float32),
        dataclasses.replace(CONFIG, **changes),
        implementation=backend,
        overlap=overlap,
        xla_options=xla_options,
    )


# Steps stay in flight only where they run without command buffers (on a GPU, large steps).
NO_GRAPHS = LARGE_STEP_XLA_OPTIONS


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


def _generate(engine: Engine, prompts, params):
    with jaxpaged.quiet_triton_deprecation():
        return engine.generate(prompts, params)


def _assert_same(seqs, refs):
    for seq, ref in zip(seqs, refs, strict=True):
        assert seq.output == ref.output, (seq.id, seq.output, ref.output)
        assert seq.finish_reason == ref.finish_reason
        np.testing.assert_allclose(seq.logprobs, ref.logprobs, rtol=0, atol=LOGPROB_TOL)


# Rows that finish at different steps of a block, a 1-token prompt, and sampled rows.
PROMPTS = [_prompt(n, n) for n in (5, 40, 1, 23)]
GREEDY = [SamplingParams(n) for n in (21, 9, 30, 14)]
SAMPLED = [
    SamplingParams(21, 0.8, seed=3),
    SamplingParams(9, 1.0, seed=4, top_k=5),
    SamplingParams(30, 1.2, seed=5, top_p=0.8),
    SamplingParams(14, 0.7, seed=6, top_k=40, top_p=0.9),
]


@functools.cache
def _reference(backend, sampled: bool):
    return _generate(_engine(backend, decode_steps=None), PROMPTS, SAMPLED if sampled else GREEDY)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_steps", [1, 3, 8, 32])
def test_blocks_give_the_per_step_engines_greedy_tokens(backend, num_steps):
    require(backend)
    engine = _engine(backend, decode_steps=num_steps)
    seqs = _generate(engine, PROMPTS, GREEDY)
    assert engine.stats.blocks > 0
    _assert_same(seqs, _reference(backend, False))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_steps", [3, 8])
def test_sampled_tokens_depend_on_seed_not_block_or_batch(backend, num_steps):
    """Temperature, top-k and top-p rows sample the same tokens in blocks of any size, batched
    together or each run alone; another seed samples other tokens."""
    require(backend)
    batched = _generate(_engine(backend, decode_steps=num_steps), PROMPTS, SAMPLED)
    _assert_same(batched, _reference(backend, True))
    alone = _engine(backend, decode_steps=num_steps + 2, max_seqs=1)
    for prompt, params, seq in zip(PROMPTS, SAMPLED, batched, strict=True):
        [ref] = _generate(alone, [prompt], params)
        assert ref.output == seq.output
    reseeded = [dataclasses.replace(p, seed=p.seed + 100) for p in SAMPLED]
    other = _generate(_engine(backend, decode_steps=num_steps), PROMPTS, reseeded)
    assert any(a.output != b.output for a, b in zip(other, batched, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_token_ends_its_row_at_that_token(backend):
    """Each row stops at the first occurrence of its stop token (mid-block), keeping it as its
    last token; the other rows run on as they would alone."""
    require(backend)
    refs = _reference(backend, False)
    params = []
    for i, (p, ref) in enumerate(zip(GREEDY, refs, strict=True)):
        stop = ref.output[len(ref.output) // 2] if i % 2 == 0 else VOCAB - 1
        params.append(dataclasses.replace(p, stop_token_ids=(stop, VOCAB - 2)))
    engine = _engine(backend, decode_steps=8)
    seqs = _generate(engine, PROMPTS, params)
    for i, (seq, ref, p) in enumerate(zip(seqs, refs, params, strict=True)):
        stops = [j for j, t in enumerate(ref.output) if t in p.stop_token_ids]
        end = stops[0] + 1 if stops else len(ref.output)
        assert seq.output == ref.output[:end]
        assert seq.finish_reason == ("stop" if stops else "length")
        assert i % 2 or stops  # the even rows' stop token is in their continuation
    per_step = _generate(_engine(backend, decode_steps=None), PROMPTS, params)
    _assert_same(seqs, per_step)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True])
def test_a_block_follows_a_step_that_samples_before_the_host_reads_it(backend, sampled):
    """The step that completes the last prompt (beside the other rows' decode tokens) takes
    every slot: the first decode block is enqueued behind it, its rows' tokens the step's
    samples on the device. Tokens and log-probabilities are the per-step engine's. With a slot
    free (a request could start) or without overlap, no block is enqueued so."""
    require(backend)
    params = SAMPLED if sampled else GREEDY
    engine = _engine(backend, decode_steps=8)
    seqs = _generate(engine, PROMPTS, params)
    assert engine.stats.blocks_after_steps == 1
    _assert_same(seqs, _reference(backend, sampled))
    _check_pool(engine)
    for changes in (dict(max_seqs=5), dict(overlap=False)):
        engine = _engine(backend, decode_steps=8, **changes)
        _assert_same(_generate(engine, PROMPTS, params), _reference(backend, sampled))
        assert engine.stats.blocks_after_steps == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_token_sampled_by_the_step_before_the_block_ends_its_row(backend):
    """Rows that sample a stop token in the step a block is enqueued behind (a decode row's
    token, and a prompt's first token) end at it: they are inactive in the block, whose other
    rows run on as they would alone, and their slots are released after it."""
    require(backend)
    refs = _reference(backend, False)
    # The step that completes prompt 3 samples row 0's second token and row 3's first.
    params = list(GREEDY)
    params[0] = dataclasses.replace(params[0], stop_token_ids=(refs[0].output[1],))
    params[3] = dataclasses.replace(params[3], stop_token_ids=(refs[3].output[0],))
    engine = _engine(backend, decode_steps=8)
    seqs = _generate(engine, PROMPTS, params)
    assert engine.stats.blocks_after_steps == 1
    for seq, ref, p in zip(seqs, refs, params, strict=True):
        stops = [j for j, t in enumerate(ref.output) if t in p.stop_token_ids]
        assert seq.output == ref.output[: stops[0] + 1 if stops else None]
    assert [s.finish_reason for s in seqs] == ["stop", "length", "length", "stop"]
    assert len(seqs[0].output) <= 2 and len(seqs[3].output) == 1
    assert np.asarray(engine.pool.free).all()


def test_a_block_behind_a_failed_step_runs_no_step():
    """`block_inputs_after_step`: rows start from the step's samples; a row whose sample is a
    stop token is inactive, and every row is where the step failed, so that the block enqueued
    behind it runs no step and changes no page and no slot."""
    engine = _engine("xla", decode_steps=4)
    seqs = [engine.add_request(_prompt(n, n), SamplingParams(9)) for n in (7, 12)]
    while not all(s.output for s in seqs):
        engine.step()
    engine.sync()
    inputs = engine._block_inputs(seqs)
    samples = jnp.array([11, 23, 5, 6], jnp.int32)
    stop_ids = inputs.sampling.stop_ids.copy()
    stop_ids[1, 0] = 23
    inputs = inputs._replace(sampling=inputs.sampling._replace(stop_ids=stop_ids))
    ran = block_inputs_after_step(samples, jnp.bool_(True), inputs)
    np.testing.assert_array_equal(ran.tokens[:2], [11, 23])
    np.testing.assert_array_equal(ran.budgets, [8, 0, 0, 0])
    failed = block_inputs_after_step(samples, jnp.bool_(False), inputs)
    np.testing.assert_array_equal(failed.budgets, 0)
    before = jax.device_get((engine.kv_pages, engine.pool))
    engine.kv_pages, engine.pool, out = engine.block_fn(
        engine.param_leaves,
        engine.kv_pages,
        engine.pool,
        failed,
        num_steps=4,
        implementation="xla",
        sampling_case=0,
    )
    assert int(out.steps) == 0 and bool(out.ok)
    np.testing.assert_array_equal(out.counts, 0)
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get((engine.kv_pages, engine.pool)), before
    )


def test_a_block_follows_a_step_only_where_the_pool_holds_its_growth():
    """The block behind a step reserves a block's tokens for every row beside what the step
    leaves; where the pool cannot hold them, none is enqueued so (the release of rows that
    finish in the step would come after it)."""
    lengths, steps = (16, 32, 12, 3), 8  # 63 tokens: one step of the budget of 64
    held = sum(-(-n // PAGE) for n in lengths)
    growth = sum(-(-(n + steps) // PAGE) - -(-n // PAGE) for n in lengths)
    for num_pages, follows in ((held + growth, True), (held + growth - 1, False)):
        engine = _engine("xla", decode_steps=steps, num_pages=num_pages, max_model_len=48)
        for n in lengths:
            engine.add_request(_prompt(n, n), SamplingParams(4))
        plan = engine.scheduler.schedule()
        assert len(plan.chunks) == 4 and all(c.samples for c in plan.chunks)
        assert engine._block_may_follow(plan) == follows


@pytest.mark.parametrize(
    ("last", "follows"),
    [(SamplingParams(4), True), (SamplingParams(1), False), (SamplingParams(4, n=2), False)],
)
def test_no_block_follows_a_step_that_ends_a_row_or_forks(last, follows):
    """No block is enqueued behind a step whose last admission ends with its first token (its
    slot comes free: a request could start) or is forked after it (its samples start after
    the step)."""
    engine = _engine("xla", decode_steps=8, max_seqs=4 + (last.n - 1))
    for n in (16, 20, 12):
        engine.add_request(_prompt(n, n), SamplingParams(4))
    engine.add_request(_prompt(9, 9), last)
    plan = engine.scheduler.schedule()
    assert len(plan.chunks) == 4 and not engine.scheduler.free_slots
    assert engine._block_may_follow(plan) == follows


def test_block_steps_is_the_most_steps_the_free_pages_and_capacities_hold():
    pool = jaxpaged.create_pool(6, 4, 4, 4)  # 6 pages of 4 tokens, 16 tokens a slot
    pool, ok = jaxpaged.reserve(pool, jnp.array([0, 1]), jnp.array([3, 8]))  # 3 pages, 3 free
    assert ok
    ids = jnp.array([0, 1, -1, 3], jnp.int32)
    budgets = jnp.array([20, 2, 5, 0], jnp.int32)
    # Slot 0 needs a page at 5, 9 and 13 tokens; slot 1 one at 9 (its budget of 2 caps it at
    # 10); padding and the row without budget never grow. 3 free pages: slot 0 reaches 12.
    steps, lens = block_steps(pool, ids, budgets, 16)
    assert int(steps) == 9
    np.testing.assert_array_equal(np.asarray(lens), [12, 10, 0, 0])
    # Slot 0's capacity (16 tokens) stops it first with pages to spare.
    pool = jaxpaged.release(pool, jnp.array([1]))
    steps, lens = block_steps(pool, jnp.array([0, -1, -1, -1]), budgets, 16)
    assert int(steps) == 13
    np.testing.assert_array_equal(np.asarray(lens), [16, 0, 0, 0])
    steps, _ = block_steps(pool, jnp.array([0, -1, -1, -1]), budgets, 4)
    assert int(steps) == 4


def test_rows_stopping_mid_block_give_back_the_pages_reserved_for_them():
    """A block reserves its steps' pages before it runs them; a row that stops at a stop token
    mid-block holds, after the block, exactly the tokens it cached, and the pool exactly the
    pages those need (as steps run one at a time leave it)."""
    refs = _reference("xla", False)
    # Row 0 stops at the first occurrence of its 4th token: mid-block, after the prefill step
    # sampled its first token.
    stop = refs[0].output[3]
    end = refs[0].output.index(stop)
    params = [dataclasses.replace(GREEDY[0], stop_token_ids=(stop,)), *GREEDY[1:]]
    engine = _engine("xla", decode_steps=8, overlap=False)
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    while any(s.num_cached < len(s.tokens) - 1 for s in seqs):
        engine.step()
    engine.sync()
    rows = [s for s in seqs if not s.finished]
    assert seqs[0] in rows
    remaining = end + 1 - len(seqs[0].output)  # tokens to the stop token, which it keeps
    assert 1 <= remaining < 8
    before = np.asarray(engine.pool.kv_lens).copy()
    out = jax.device_get(engine._launch_block(engine._block_inputs(rows), rows))
    pool = jax.device_get(engine.pool)
    assert out.ok and int(out.steps) == 8
    assert out.counts[0] == remaining  # row 0 stopped mid-block
    for i, seq in enumerate(rows):
        assert pool.kv_lens[seq.slot] == before[seq.slot] + out.counts[i], seq.id
        assert pool.num_owned[seq.slot] == -(-pool.kv_lens[seq.slot] // PAGE)
    held = np.concatenate([pool.page_indices[s, :n] for s, n in enumerate(pool.num_owned)])
    np.testing.assert_array_equal(pool.refcount, np.bincount(held, minlength=pool.num_pages))


def test_blocks_on_a_small_pool_pause_and_preempt_without_corruption():
    """Sixteen requests need far more pages than the pool's 12; blocks stop before a step the
    pool cannot hold, sequences get preempted and recomputed, and after every block the pool is
    consistent and every running sequence's cached K/V are bitwise what they were."""
    prompts = [_prompt(n, 100 + n) for n in (30, 50, 12, 61, 44, 7, 25, 38) * 2]
    params = [SamplingParams(24 + i % 5, 0.0 if i % 3 else 0.9, seed=i) for i in range(16)]
    engine = _engine("xla", num_pages=12, decode_steps=8, chunk_size=32)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_work():
        before = {s.id: (s.slot, _cached_kv(engine, s)) for s in engine.scheduler.running}
        engine.step()
        engine.sync()
        _check_pool(engine)
        for s in engine.scheduler.running:
            if s.id in before and before[s.id][0] == s.slot:
                for old, new in zip(before[s.id][1], _cached_kv(engine, s), strict=True):
                    np.testing.assert_array_equal(new[: len(old)], old)
    assert engine.scheduler.num_preemptions > 0 and engine.stats.cut_blocks > 0
    assert np.asarray(engine.pool.free).all()
    refs = _generate(_engine("xla", decode_steps=None, num_pages=200), prompts, params)
    _assert_same(seqs, refs)


def test_blocks_recover_when_the_scheduler_overbooks_the_pool():
    """With a scheduler that believes the pool is endless, only the blocks' reservations stop
    blocks; the engine preempts and retries, and the results are still right."""
    prompts = [_prompt(n, 200 + n) for n in (30, 50, 12, 61, 44, 7)]
    params = [SamplingParams(20) for _ in prompts]
    engine = _engine("xla", num_pages=10, decode_steps=8, chunk_size=32)
    engine.scheduler.num_pages = 10**6
    seqs = _generate(engine, prompts, params)
    assert engine.stats.failed_steps > 0 and engine.stats.cut_blocks > 0
    _assert_same(seqs, _generate(_engine("xla", decode_steps=None), prompts, params))


def test_overlap_enqueues_the_next_block_before_reading_this_one():
    engine = _engine("xla", decode_steps=4)
    launched_ahead = 0
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, GREEDY, strict=True)]
    while engine.has_work():
        finished_blocks = engine.stats.blocks
        engine.step()
        # A block was read in this call and the next one is already in flight.
        launched_ahead += engine.stats.blocks > finished_blocks and engine._block is not None
    assert launched_ahead > 0
    _assert_same(seqs, _generate(_engine("xla", decode_steps=4, overlap=False), PROMPTS, GREEDY))


def test_a_step_that_does_not_wait_returns_while_the_block_runs():
    """`step(wait=False)` while the block in flight runs enqueues and reads nothing; once it
    has ended, the call enqueues the next block, or, with a request added meanwhile, none
    (that request is admitted by the step after). The tokens are those of `wait=True`."""
    prompts, params = [_prompt(9, 1), _prompt(11, 2)], [SamplingParams(30), SamplingParams(5)]
    engine = _engine("xla", decode_steps=4)
    running = True
    engine._block_ending = lambda: not running
    first = engine.add_request(prompts[0], params[0])
    while engine._block is None:
        engine.step(wait=False)
    counts = lambda: (engine.stats.steps, engine.stats.blocks, engine._prompt_steps)  # noqa: E731
    block, before = engine._block, counts()
    for _ in range(3):
        assert engine.step(wait=False) == []
    assert engine._block is block and counts() == before and len(first.output) == 1
    running = False
    engine.step(wait=False)  # reads the block, having enqueued the next one
    assert engine._block is not None and engine._block is not block
    assert len(first.output) == 5
    running = True
    late = engine.add_request(prompts[1], params[1])
    assert engine.step(wait=False) == [] and late.num_cached == 0
    running = False
    engine.step(wait=False)  # reads the block, enqueues none: a request waits
    assert engine._block is None and len(first.output) == 9 and late.num_cached == 0
    engine.step(wait=False)  # the mixed step that admits it
    assert late.num_cached == len(late.tokens) - 1 and len(late.output) == 1
    while engine.has_work():
        engine.step(wait=False)
    waited = _engine("xla", decode_steps=4)
    refs = [waited.add_request(prompts[0], params[0])]
    while len(refs[0].output) < 9:
        waited.step()
    refs.append(waited.add_request(prompts[1], params[1]))
    while waited.has_work():
        waited.step()
    _assert_same([first, late], refs)


def test_a_step_that_does_not_wait_waits_while_no_slot_can_free():
    """With every slot taken and no row's budget ending within the block in flight,
    `step(wait=False)` does what `step()` does: it enqueues the next block and reads this
    one (a request could not start sooner). Once a row's budget ends within the block in
    flight, it returns at once again."""
    engine = _engine("xla", decode_steps=4)
    running = True
    engine._block_ending = lambda: not running
    prompts = [_prompt(5 + i, 30 + i) for i in range(4)]
    params = [SamplingParams(14 + i) for i in range(4)]
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine._block is None:
        engine.step(wait=False)
    assert not engine.scheduler.free_slots and all(len(s.output) == 1 for s in seqs)
    # Budgets of 13-16 tokens left as the host sees them, then 9-12, then 5-8: nobody's ends
    # within the block in flight, whose 4 tokens a row the host has not read yet.
    for read in (5, 9, 13):
        block = engine._block
        engine.step(wait=False)
        assert engine._block is not block and [len(s.output) for s in seqs] == [read] * 4
    block = engine._block
    assert engine.step(wait=False) == []  # 1-4 left: every row ends within the block in flight
    assert engine._block is block and [len(s.output) for s in seqs] == [13] * 4
    running = False
    while engine.has_work():
        engine.step(wait=False)
    _assert_same(seqs, _generate(_engine("xla", decode_steps=4), prompts, params))


def test_a_block_is_ending_within_the_launch_lead_of_its_expected_end():
    """`step(wait=False)` enqueues the next block once the block in flight has run for as
    long as the last full block took, less `BLOCK_LAUNCH_LEAD_S`; before any full block, only
    once it has ended."""

    class Running:  # the outputs of a block that has not ended
        def is_ready(self):
            return False

    engine = _engine("xla", decode_steps=4)
    seq = engine.add_request(_prompt(9, 1), SamplingParams(30))
    while engine._block is None:
        engine.step()
    out = engine._block.out
    engine._block = engine._block._replace(out=out._replace(steps=Running()))
    assert engine._block_step_s is None and not engine._block_ending()
    engine._block_step_s = 1.0  # 4 s a block
    engine._clock = time.perf_counter() - 3.0
    assert not engine._block_ending()
    engine._clock -= 1.0 - BLOCK_LAUNCH_LEAD_S / 2  # within the lead of the 4 s
    assert engine._block_ending()
    engine._block = engine._block._replace(out=out)
    assert engine._block_ending()
    engine._clock = time.perf_counter()
    engine.step()  # reads the block: its 4 steps give the time per step
    assert 0 < engine._block_step_s < 1.0
    while engine.has_work():
        engine.step(wait=False)
    [ref] = _generate(_engine("xla", decode_steps=4), [_prompt(9, 1)], SamplingParams(30))
    _assert_same([seq], [ref])


def test_request_arriving_during_a_block_waits_at_most_that_block():
    """A request added while a block runs gets its first prefill step right after that block:
    the engine enqueues no further block ahead of it."""
    engine = _engine("xla", decode_steps=4)
    engine.add_request(_prompt(9, 1), SamplingParams(40))
    while not engine.stats.blocks and engine._block is None:
        engine.step()
    late = engine.add_request(_prompt(11, 2), SamplingParams(3))
    engine.step()  # finishes the block in flight and enqueues none
    assert engine._block is None and late.num_cached == 0
    engine.step()  # the mixed step that admits it
    assert late.num_cached == len(late.tokens) - 1 and len(late.output) == 1


@pytest.mark.parametrize("mask_pages", [True, False])
@pytest.mark.parametrize("step", [0, 5, 13])
def test_block_decode_metadata_equals_the_ragged_build(step, mask_pages):
    """A block step's metadata, written out for one token per row, is `StepMetadata.build`'s
    for the same rows: kv_lens, slots and the pages of active rows, positions where a row is
    active (0 for padding), across page boundaries and for rows with no pages. Without
    `mask_pages` inactive rows keep their pages (their kv_len 0 reads none)."""
    rng = np.random.default_rng(step)
    rows, pages_per_seq, page_size, num_pages = 12, 6, 4, 96
    cached = jnp.asarray(rng.integers(0, pages_per_seq * page_size - 16, rows), jnp.int32)
    table = rng.permutation(num_pages)[: rows * pages_per_seq].reshape(rows, pages_per_seq)
    table = jnp.asarray(table, jnp.int32).at[3].set(-1)  # a padding row: no pages
    active = jnp.asarray(rng.random(rows) < 0.7).at[3].set(False).at[0].set(True)
    got = _decode_metadata(cached, table, active, jnp.int32(step), page_size, mask_pages=mask_pages)
    want = jaxpaged.StepMetadata.build(
        jnp.where(active, cached + step + 1, 0),
        jnp.where(active[:, None], table, -1),
        jnp.arange(rows + 1, dtype=jnp.int32),
        rows,
        num_tokens=rows,
        decode=True,
        pool_shape=(num_pages, page_size),
    )
    for name in ("kv_lens", "cu_q_lens", "num_seqs", "kv_slots"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(got.page_indices, want.page_indices if mask_pages else table)
    np.testing.assert_array_equal(got.positions, jnp.where(active, want.positions, 0))
    assert got.decode and (np.asarray(got.kv_slots)[np.asarray(active)] >= 0).all()


def test_packed_trees_cross_between_host_and_device_bit_for_bit():
    """A step's host inputs reach the jitted call as one i32 array (`Packed.pack` on numpy,
    `unpack` inside), and what the host reads of a step comes back as one (`pack` inside,
    `to_host`): each leaf keeps its shape, dtype and bits (floats, u32 seeds above 2**31,
    bools, a None left as None). Calls of one layout share a compile; a leaf of another
    width is refused."""
    rng = np.random.default_rng(0)

    def inputs(num_tokens, rows=4):
        return StepInputs(
            rng.integers(0, 1000, num_tokens, dtype=np.int32),
            rng.integers(-1, rows, rows, dtype=np.int32),
            np.sort(rng.integers(0, num_tokens, rows + 1, dtype=np.int32)),
            np.int32(rng.integers(1, rows)),
            rng.integers(0, rows, rows, dtype=np.int32),
            SamplingArrays(
                rng.uniform(0.1, 2.0, rows).astype(np.float32),
                rng.integers(0, 50, rows, dtype=np.int32),
                rng.uniform(0.1, 1.0, rows).astype(np.float32),
                rng.integers(2**31, 2**32, rows, dtype=np.uint32),
                rng.integers(-1, 1000, (rows, 3), dtype=np.int32),
            ),
            rng.integers(0, 100, rows, dtype=np.int32),
        )

    unpack = jax.jit(Packed.unpack)
    for num_tokens in (8, 8, 16):
        host = inputs(num_tokens)
        packed = Packed.pack(host)
        size = sum(np.size(x) for x in jax.tree.leaves(host))  # 46 beside the tokens
        assert [x.shape for x in jax.tree.leaves(packed)] == [(size,)] and size == num_tokens + 46
        restored = unpack(packed)
        assert jax.tree.structure(restored) == jax.tree.structure(host)
        for want, got in zip(jax.tree.leaves(host), jax.tree.leaves(restored), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), want)
    assert unpack._cache_size() == 2  # one per layout: 8 and 16 tokens

    # The way back: a step's outputs, packed inside the jit and read on the host.
    tokens = rng.integers(0, 1000, 4, dtype=np.int32)
    logprobs = -rng.uniform(0, 10, 4).astype(np.float32)
    table = rng.integers(-1, 100, (4, 5), dtype=np.int32)
    for ok in (True, False):
        read = jax.jit(lambda *a: Packed.pack((a[0], None, a[1], a[2], a[3], a[4])))(
            tokens, np.bool_(ok), np.bool_(not ok), logprobs, table
        )
        assert len(jax.tree.leaves(read)) == 1
        t, none, got_ok, shared, lp, tab = read.to_host()
        assert none is None and got_ok.dtype == np.bool_ and bool(got_ok) is ok
        assert bool(shared) is (not ok)
        np.testing.assert_array_equal(t, tokens)
        np.testing.assert_array_equal(lp, logprobs)
        np.testing.assert_array_equal(tab, table)
    for bad in (np.zeros(3, np.int64), np.zeros(3, np.float16)):
        with pytest.raises(TypeError, match="4-byte and bool dtypes"):
            Packed.pack((np.zeros(3, np.int32), bad))


def test_block_updates_pages_and_pool_in_place_and_compiles_once():
    """Once per sampling case: after a greedy and a sampled warm-up, nothing compiles."""
    engine = _engine("xla", decode_steps=4)
    _generate(engine, PROMPTS[:2], GREEDY[:2])
    _generate(engine, PROMPTS[:1], [SamplingParams(5, 0.7, seed=3)])
    seq = engine.add_request(_prompt(20, 5), SamplingParams(6))
    while seq.num_cached < seq.prompt_len:
        engine.step()
    inputs = engine._block_inputs([seq])
    options = dict(num_steps=4, implementation="xla")
    compiled = engine.block_fn.lower(
        engine.param_leaves, engine.kv_pages, engine.pool, inputs, **options
    ).compile()
    state = jax.tree.leaves((engine.kv_pages, engine.pool))
    assert compiled.memory_analysis().alias_size_in_bytes >= sum(x.nbytes for x in state)
    with count_compilations() as compiles:
        old = engine.kv_pages[0][0]
        while engine.has_work():
            engine.step()
        _generate(engine, [_prompt(n, n) for n in (3, 33)], [SamplingParams(7, 0.5), GREEDY[0]])
    assert old.is_deleted()
    assert not compiles, f"{len(compiles)} compilations after warm-up"


def test_soak_random_requests_each_equal_to_running_alone():
    """200 requests of random prompt lengths, max_new_tokens, stop tokens and 1 to 3 samples
    arrive while others run, through a pool small enough to force preemptions; every sample
    finishes with the greedy output the request has alone (computed once without stop tokens,
    then cut at the first stop)."""
    rng = np.random.default_rng(7)
    num_requests = 200
    prompts = [_prompt(int(rng.integers(1, 60)), 1000 + i) for i in range(num_requests)]
    max_new = rng.integers(1, 24, num_requests)
    alone_engine = _engine("xla", decode_steps=16, max_seqs=1, max_model_len=96)
    alone = [
        _generate(alone_engine, [p], SamplingParams(int(n)))[0].output
        for p, n in zip(prompts, max_new, strict=True)
    ]
    params, expected = [], []
    # Drawn from a generator of their own: the other draws stay those of the test without them.
    num_samples = np.random.default_rng(8).choice([1, 1, 2, 3], num_requests).tolist()
    for out, n in zip(alone, max_new, strict=True):
        stops = (int(rng.choice(out)),) if rng.random() < 0.5 else ()
        stops += tuple(int(t) for t in rng.integers(0, VOCAB, int(rng.integers(0, 3))))
        params.append(SamplingParams(int(n), stop_token_ids=stops, n=int(num_samples.pop())))
        hits = [j for j, t in enumerate(out) if t in stops]
        expected.append(out[: hits[0] + 1] if hits else out)
    engine = _engine("xla", decode_steps=8, max_seqs=8, num_pages=14, max_model_len=96)
    order = iter(range(num_requests))
    seqs = {}
    while len(seqs) < num_requests or engine.has_work():
        for i in [next(order, None) for _ in range(int(rng.integers(0, 4)))]:
            if i is not None:
                seqs[i] = engine.add_request(prompts[i], params[i])
        engine.step()
    assert engine.scheduler.num_preemptions > 0 and engine.stats.cut_blocks > 0
    # The tight pool leaves a block behind a step little room, but the path runs here too.
    assert engine.stats.blocks_after_steps > 0
    assert sum(s.finish_reason == "stop" for s in seqs.values()) > 20
    assert engine.stats.forked_samples > 100 and engine.stats.failed_forks == 0
    for i, seq in seqs.items():
        assert len(seq.samples) == params[i].n
        for sample in seq.samples:
            assert sample.finished and sample.output == expected[i], (i, sample.sample_index)
    assert np.asarray(engine.pool.free).all()


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(stop_token_ids=(3, -2)), "stop_token_ids"),
        (dict(n=0), "n"),
        (dict(n=2.0), "n"),
    ],
)
def test_invalid_sampling_params_name_the_field(changes, name):
    with pytest.raises(ValueError, match=f"SamplingParams.{name} must be"):
        SamplingParams(**changes)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(4), "non-empty prompt"),
        ([1] * 150, SamplingParams(20), "max_model_len"),
        ([1, VOCAB], SamplingParams(4), "prompt token ids"),
        ([1], SamplingParams(4, stop_token_ids=(VOCAB,)), "stop_token_ids"),
        ([1], SamplingParams(4, stop_token_ids=tuple(range(5))), "max_stop_tokens"),
    ],
)
def test_add_request_rejects_what_the_engine_cannot_run(prompt, params, match):
    with pytest.raises(ValueError, match=match):
        _engine("xla").add_request(prompt, params)


def test_engine_config_rejects_bad_block_sizes():
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=0)
    with pytest.raises(ValueError, match="max_stop_tokens"):
        EngineConfig(max_stop_tokens=0)
    for tokens in [(0,), (8, 65)]:
        with pytest.raises(ValueError, match="mixed_step_tokens must lie in"):
            dataclasses.replace(CONFIG, mixed_step_tokens=tokens)


def test_mixed_step_sizes_halve_the_budget_down_to_256_prompt_tokens():
    """By default a mixed step also compiles at each halving of the budget of at least 256
    tokens, plus a decode token per slot; `mixed_step_tokens` names them instead, and ()
    leaves the budget alone."""
    config = EngineConfig(max_seqs=16, max_tokens_per_step=2048)
    assert config.step_token_counts == (256 + 16, 512 + 16, 1024 + 16, 2048)
    assert dataclasses.replace(config, max_tokens_per_step=600).step_token_counts == (316, 600)
    assert dataclasses.replace(config, max_tokens_per_step=511).step_token_counts == (511,)
    assert dataclasses.replace(config, mixed_step_tokens=()).step_token_counts == (2048,)
    sizes = dataclasses.replace(config, mixed_step_tokens=(2048, 100, 100, 7))
    assert sizes.step_token_counts == (7, 100, 2048)
    assert CONFIG.step_token_counts == (64,)


def _staged(engine: Engine) -> list:
    """A 50-token prompt in chunks of 40, then, each once the one before has its first token, a
    5-token and a 30-token prompt: steps of 40 prompt tokens that sample nothing, then 10,
    5 + 1 and 30 + 2 tokens that sample."""
    seqs = []
    for n in (50, 5, 30):
        seqs.append(engine.add_request(_prompt(n, 900 + n), SamplingParams(6)))
        while not seqs[-1].output:
            engine.step()
    while engine.has_work():
        engine.step()
    return seqs


def test_mixed_steps_run_at_the_smallest_size_that_holds_their_chunks():
    """A mixed step that samples runs at the smallest of `step_token_counts` that holds its
    chunks; a prompt-only step (chunks short of their prompts' ends) at the budget. The tokens
    are those of the engine whose mixed steps all take the budget."""
    sizes = dict(chunk_size=40, decode_steps=4, mixed_step_tokens=(8, 24))
    engine = _engine("xla", **sizes)
    assert engine.config.step_token_counts == (8, 24, 64)
    calls = []  # (the size called, the inputs' tokens, the chunks' tokens)

    def recorded(kind, fn):
        def call(*args, **kwargs):
            inputs = args[3].unpack()  # the `StepInputs` of the call
            calls.append((kind, inputs.tokens.shape[0], int(inputs.cu_q_lens[-1])))
            return fn(*args, **kwargs)

        return call

    engine._mixed_fns = {n: recorded(n, fn) for n, fn in engine._mixed_fns.items()}
    engine._prompt_fns = tuple(recorded("prompt", fn) for fn in engine._prompt_fns)
    with jaxpaged.quiet_triton_deprecation():
        seqs = _staged(engine)
        refs = _staged(_engine("xla", **sizes | dict(mixed_step_tokens=())))
    assert calls == [("prompt", 64, 40), (24, 24, 10), (8, 8, 6), (64, 64, 32)]
    _assert_same(seqs, refs)


def test_mixed_steps_compile_with_the_engine_and_change_nothing():
    """On a GPU the constructor runs the mixed kind once at each of its sizes
    (`_compile_mixed_steps`): a plan would otherwise compile a size when its tokens first come
    to it, seconds of stall mid-generation. Run on a plan of no chunks, it changes no page
    and no slot; a generation then compiles no mixed step, nor the inputs of a block behind
    one."""
    engine = _engine("xla", max_tokens_per_step=48, mixed_step_tokens=(9, 20), decode_steps=4)
    engine.add_request(_prompt(60, 5), SamplingParams(3))
    engine.step()  # a sequence's pages and slot to keep: its first 48 tokens, sampling nothing
    before = jax.device_get((engine.kv_pages, engine.pool))
    with count_compilations() as compiles:
        engine._compile_mixed_steps()
    # On a GPU the constructor ran it first.
    assert compiles.count("jit(step)") == (0 if jax.default_backend() == "gpu" else 3), compiles
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get((engine.kv_pages, engine.pool)), before
    )
    with count_compilations() as compiles:
        _generate(engine, [_prompt(n, 910 + n) for n in (2, 5, 19, 40)], SamplingParams(3))
    assert engine.stats.blocks_after_steps > 0
    assert not {"jit(step)", "jit(block_inputs_after_step)"} & set(compiles), compiles


# Requests of n samples: a prompt whose last page is partly filled (its copy per sample), one
# that fills its pages (nothing copied) and a one-token prompt, next to a request of one sample.
# The second request's seed wraps around: its sample 1 draws with seed 0.
SHARED_PROMPTS = [_prompt(40, 11), _prompt(2 * PAGE, 12), _prompt(1, 13), _prompt(23, 14)]
SHARED_PARAMS = {
    False: [
        SamplingParams(12, n=3),
        SamplingParams(10, n=2),
        SamplingParams(9, n=2),
        SamplingParams(7),
    ],
    True: [
        SamplingParams(12, 0.9, seed=5, n=3),
        SamplingParams(10, 1.0, seed=2**32 - 1, top_k=20, n=2),
        SamplingParams(9, 0.8, seed=9, top_p=0.9, n=2),
        SamplingParams(7, 0.7, seed=1),
    ],
}


def _separately(prompts, params) -> tuple[list, list]:
    """Each sample of the requests as a request of its own (`SamplingParams.for_sample`)."""
    pairs = [
        (p, sp.for_sample(i)) for p, sp in zip(prompts, params, strict=True) for i in range(sp.n)
    ]
    return [p for p, _ in pairs], [sp for _, sp in pairs]


def _all_samples(seqs):
    return [sample for seq in seqs for sample in seq.samples]


@functools.cache
def _separate_reference(backend, sampled: bool):
    """The samples of SHARED_PARAMS run as separate requests, per step, prompt logits recorded."""
    engine = _engine(backend, decode_steps=None)
    with jaxpaged.quiet_triton_deprecation():
        return engine.generate(
            *_separately(SHARED_PROMPTS, SHARED_PARAMS[sampled]), record_prompt_logits=True
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["blocks", "steps", "steps-logits"])
def test_n_samples_equal_separate_requests_with_derived_seeds(backend, sampled, mode):
    """Sample i of a request of n samples and seed s gives what a request of one sample and
    seed s + i gives: the same tokens, log-probabilities within 1e-5 and, recorded, float32
    prompt and output logits within 1e-5, in decode blocks and in steps one at a time. The
    prompt was computed once per request: its other samples started as forks."""
    require(backend)
    params = SHARED_PARAMS[sampled]
    engine = _engine(backend, decode_steps=8 if mode == "blocks" else None)
    with jaxpaged.quiet_triton_deprecation():
        seqs = engine.generate(SHARED_PROMPTS, params, record_prompt_logits=mode == "steps-logits")
    assert engine.stats.forked_samples == sum(p.n - 1 for p in params)
    assert engine.stats.failed_forks == 0
    assert engine.stats.prefill_tokens == sum(map(len, SHARED_PROMPTS))
    for seq, p in zip(seqs, params, strict=True):
        assert [s.sample_index for s in seq.samples] == list(range(p.n))
        assert seq.samples[0] is seq and all(s.samples is seq.samples for s in seq.samples)
        assert [s.params for s in seq.samples] == [p.for_sample(i) for i in range(p.n)]
        if sampled:  # the seeds differ, so do the samples
            assert len({tuple(s.output) for s in seq.samples}) == p.n
    samples, refs = _all_samples(seqs), _separate_reference(backend, sampled)
    _assert_same(samples, refs)
    if mode == "steps-logits":
        for seq, ref in zip(samples, refs, strict=True):
            assert np.isfinite(seq.prompt_logits).all()
            np.testing.assert_allclose(seq.prompt_logits, ref.prompt_logits, rtol=0, atol=1e-5)
            np.testing.assert_allclose(seq.output_logits, ref.output_logits, rtol=0, atol=1e-5)


def _used_pages(engine: Engine) -> int:
    return engine.config.num_pages - int(jaxpaged.num_free_pages(engine.pool))


@pytest.mark.parametrize("prompt_len", [40, 2 * PAGE], ids=["partial-page", "full-pages"])
def test_forked_samples_share_the_prompts_full_pages(prompt_len):
    """After the fork each of the 4 samples lists the prompt's full pages, held once with a
    refcount of the samples that run, and, where the prompt ends inside a page, a private copy
    of that page; every sample's pages hold the prompt's K/V. The pool peaks at least 3 copies
    of the shared pages below the peak of 4 separate requests."""
    n, full = 4, prompt_len // PAGE
    prompt, params = _prompt(prompt_len, 21), SamplingParams(20, 1.0, seed=3, n=4)
    engine = _engine("xla", decode_steps=4)
    seq = engine.add_request(prompt, params)
    peak, checked = 0, False
    while engine.has_work():
        engine.step()
        engine.sync()
        peak = max(peak, _used_pages(engine))
        assert _used_pages(engine) == engine.scheduler.num_held_pages()
        running = [s for s in seq.samples if s.slot >= 0]
        if engine.stats.forked_samples == 0 or not running:
            continue
        pool = jax.device_get(engine.pool)
        shared = pool.page_indices[running[0].slot, :full]
        for s in running:
            np.testing.assert_array_equal(pool.page_indices[s.slot, :full], shared)
        np.testing.assert_array_equal(pool.refcount[shared], len(running))
        if not checked:  # right after the fork: every sample holds the prompt's K/V
            assert len(running) == n and all(s.num_cached == prompt_len for s in running)
            owned = [pool.num_owned[s.slot] for s in running]
            assert owned == [-(-prompt_len // PAGE)] * n
            if prompt_len % PAGE:
                own = [pool.page_indices[s.slot, full] for s in running]
                assert len(set(own)) == n and (pool.refcount[own] == 1).all()
            for s in running[1:]:
                for a, b in zip(_cached_kv(engine, s), _cached_kv(engine, seq), strict=True):
                    np.testing.assert_array_equal(a, b)
            checked = True
    assert checked and engine.stats.forked_samples == n - 1
    assert np.asarray(engine.pool.free).all()

    separate = _engine("xla", decode_steps=4)
    refs = [
        separate.add_request(p, sp) for p, sp in zip(*_separately([prompt], [params]), strict=True)
    ]
    separate_peak = 0
    while separate.has_work():
        separate.step()
        separate.sync()
        separate_peak = max(separate_peak, _used_pages(separate))
    assert peak <= separate_peak - (n - 1) * full
    _assert_same(seq.samples, refs)


def _watch_pool(engine: Engine) -> list[int]:
    """The pages in use in the pool right before each release of slots (a sync each, tests
    only): the most it holds after every step or block, whose pages only grow until then."""
    used, release = [], engine._release_pending

    def watched():
        used.append(_used_pages(engine))
        release()

    engine._release_pending = watched
    return used


def test_peak_pages_of_n_samples_are_those_of_separate_requests_less_the_shared_ones():
    """4 samples of a 16-token prompt (one full page) that generate 12 tokens (27 cached at the
    end: 2 pages each) peak at 1 shared page + 4 x 1 = 5 pages, and 4 separate requests, all
    admitted in one step (64 tokens, the step's budget), at 4 x 2 = 8; both peaks are the most
    the pool's refcounts show. (`benchmarks.sharing --smoke` checks prompts whose last page
    is partly filled, copied per sample.)"""
    n, prompt = 4, _prompt(PAGE, 51)
    params = SamplingParams(12, 1.0, seed=4, n=n)
    peaks, used, outputs = [], [], []
    for prompts, ps in (([prompt], [params]), _separately([prompt], [params])):
        engine = _engine("xla")
        used.append(_watch_pool(engine))
        outputs.append(_all_samples(_generate(engine, prompts, ps)))
        peaks.append(engine.stats.peak_pages)
    assert peaks == [1 + n * 1, n * 2]
    assert [max(u) for u in used] == peaks
    _assert_same(*outputs)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_peak_pages_are_the_most_the_pool_holds(prefix_caching):
    """A short request finishes in the first decode block while the second, enqueued before
    the host read the first, runs the 2 samples of a long one a page further: the pool is
    fullest at the second block's end, with the short one's pages still held (their release
    waits for that block). Then a request on the long prompt's first page (cached or not).
    The peak counted on the host is the most pages the pool's refcounts show."""
    long, short = _prompt(20, 61), _prompt(30, 62)
    engine = _engine("xla", prefix_caching=prefix_caching)
    used = _watch_pool(engine)
    # 39 tokens after the prefill step: blocks of 16, 16 and 7; the short one's 9 in the first.
    _generate(engine, [long, short], [SamplingParams(40, 1.0, seed=1, n=2), SamplingParams(10)])
    _generate(engine, [long[:PAGE] + short[:10]], SamplingParams(5))
    assert engine.stats.peak_pages == max(used)
    assert engine.stats.prefix_hit_pages == int(prefix_caching)


def _run_checking_pool(engine: Engine, prompts, params):
    """Run to completion, checking after every step or block that the pool is consistent and
    that the scheduler counts the pages it holds (shared ones once)."""
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_work():
        engine.step()
        engine.sync()
        _check_pool(engine)
        assert _used_pages(engine) == engine.scheduler.num_held_pages()
    assert np.asarray(engine.pool.free).all()
    return seqs


SMALL_POOL_PROMPTS = [_prompt(n, 300 + n) for n in (30, 50, 12, 61, 44, 7)]
SMALL_POOL_PARAMS = [
    SamplingParams(24 + i % 5, 0.0 if i % 3 else 0.9, seed=i, n=1 + i % 4) for i in range(6)
]


@pytest.mark.parametrize("decode_steps", [None, 8], ids=["steps", "blocks"])
def test_n_samples_on_a_small_pool_preempt_and_give_the_same_outputs(decode_steps):
    """On a 12-page pool the requests wait for pages and slots and get preempted, before their
    fork (all samples wait with sample 0) and after (one sample is recomputed alone); every
    sample still gives what it gives as a request of its own on a large pool."""
    engine = _engine("xla", num_pages=12, decode_steps=decode_steps, chunk_size=32)
    seqs = _run_checking_pool(engine, SMALL_POOL_PROMPTS, SMALL_POOL_PARAMS)
    assert engine.scheduler.num_preemptions > 0 and engine.stats.forked_samples > 0
    if decode_steps is None:
        assert engine.stats.failed_steps == 0  # the scheduler's page counts are the pool's
    refs = _generate(
        _engine("xla", decode_steps=None, num_pages=200),
        *_separately(SMALL_POOL_PROMPTS, SMALL_POOL_PARAMS),
    )
    _assert_same(_all_samples(seqs), refs)


def test_a_fork_the_pool_cannot_hold_leaves_its_samples_to_recompute():
    """A slot the scheduler does not know of holds 9 of the 12 pages, so the fork after the
    prompt finds no page for its copies: it changes nothing, and its samples wait and compute
    their prompts on their own (the steps that overbook the pool fail and preempt) and give
    the same outputs."""
    engine = _engine("xla", num_pages=12)
    engine.scheduler.free_slots.remove(CONFIG.max_seqs - 1)
    engine.pool, ok = jaxpaged.reserve(
        engine.pool, jnp.asarray([CONFIG.max_seqs - 1]), jnp.asarray([9 * PAGE])
    )
    assert bool(ok)
    prompt, params = _prompt(40, 41), SamplingParams(6, 0.8, seed=2, n=3)
    [seq] = _generate(engine, [prompt], params)
    assert engine.stats.failed_forks == 1 and engine.stats.forked_samples == 0
    assert engine.stats.failed_steps > 0
    _assert_same(seq.samples, _generate(_engine("xla"), *_separately([prompt], [params])))


def test_samples_that_finish_with_their_first_token_are_not_forked():
    """One new token each: no fork. A stop token that ends sample 0 at its first token: the
    other samples still fork from its slot before it is released."""
    prompt = _prompt(40, 31)
    params = SamplingParams(10, 1.0, seed=17, n=3)
    refs = _generate(_engine("xla"), *_separately([prompt], [params]))
    firsts = [r.output[0] for r in refs]
    assert firsts[0] not in firsts[1:]
    engine = _engine("xla")
    [one] = _generate(engine, [prompt], dataclasses.replace(params, max_new_tokens=1))
    assert [s.output for s in one.samples] == [[t] for t in firsts]
    assert engine.stats.forked_samples == 0 and np.asarray(engine.pool.free).all()
    stopped = dataclasses.replace(params, stop_token_ids=(firsts[0],))
    engine = _engine("xla")
    [seq] = _run_checking_pool(engine, [prompt], [stopped])
    assert seq.output == [firsts[0]] and seq.finish_reason == "stop"
    assert engine.stats.forked_samples == 2
    for sample, ref in zip(seq.samples[1:], refs[1:], strict=True):
        stops = [j for j, t in enumerate(ref.output) if t == firsts[0]]
        assert sample.output == ref.output[: stops[0] + 1 if stops else None]


def test_fork_updates_pages_and_pool_in_place_and_compiles_once():
    engine = _engine("xla", decode_steps=4)
    # Warm-up: a fork, and a block that samples with a temperature (its own compile).
    _generate(engine, [_prompt(20, 1)], SamplingParams(3, n=2))
    _generate(engine, [_prompt(20, 2)], SamplingParams(3, 0.5))
    compiled = fork_samples.lower(
        engine.kv_pages, engine.pool, np.int32(0), np.full(CONFIG.max_seqs, -1, np.int32)
    ).compile()
    state = jax.tree.leaves((engine.kv_pages, engine.pool))
    assert compiled.memory_analysis().alias_size_in_bytes >= sum(x.nbytes for x in state)
    old = engine.kv_pages[0][0]
    with count_compilations() as compiles:
        seqs = _generate(
            engine,
            [_prompt(n, n) for n in (3, 33, 16)],
            [SamplingParams(5, n=4), SamplingParams(6, 0.5, n=3), SamplingParams(4, n=2)],
        )
    assert not compiles, f"{len(compiles)} compilations after warm-up"
    assert old.is_deleted() and engine.stats.forked_samples == 1 + 3 + 2 + 1
    assert [len(s.samples) for s in seqs] == [4, 3, 2]


def test_for_sample_derives_the_seed_and_one_sample():
    params = SamplingParams(5, 0.7, seed=2**32 - 2, top_k=3, n=4)
    assert [params.for_sample(i).seed for i in range(4)] == [2**32 - 2, 2**32 - 1, 0, 1]
    assert params.for_sample(2) == dataclasses.replace(params, seed=0, n=1)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(max_seqs=2), "SamplingParams.n=3 needs a slot per sample"),
        (dict(num_pages=10), r"12 pages for the 145-token prompt"),
    ],
)
def test_add_request_rejects_more_samples_than_slots_or_pages(changes, match):
    with pytest.raises(ValueError, match=match):
        _engine("xla", **changes).add_request([1] * 145, SamplingParams(4, n=3))


def _check_cached_pool(engine: Engine) -> None:
    """`_check_pool` with a prefix cache: each page's refcount is the slots that hold it plus
    one where the cache holds it, and the scheduler counts the pool's used pages."""
    pool = jax.device_get(engine.pool)
    held = np.concatenate([pool.page_indices[s, :n] for s, n in enumerate(pool.num_owned)])
    cached = [p in engine.scheduler.cache for p in range(pool.num_pages)]
    np.testing.assert_array_equal(
        pool.refcount, np.bincount(held, minlength=pool.num_pages) + cached
    )
    for seq in engine.scheduler.running:
        assert pool.kv_lens[seq.slot] == seq.num_cached
        assert pool.num_owned[seq.slot] == -(-seq.num_cached // PAGE)
    assert _used_pages(engine) == engine.scheduler.num_held_pages()


def _cached_engine(backend="xla", **changes) -> Engine:
    return _engine(backend, prefix_caching=True, **changes)


def _run_checking_cached_pool(engine: Engine, prompts, params, *, record: bool = False):
    """Run to completion, checking the pool after every step or block (`_check_cached_pool`).
    Returns the sequences and, by sequence id, its page table row after its first step."""
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    first_rows = {}
    with jaxpaged.quiet_triton_deprecation():
        while engine.has_work():
            engine.step(record_prompt_logits=record)
            engine.sync()
            _check_cached_pool(engine)
            table = np.asarray(engine.pool.page_indices)
            for s in engine.scheduler.running:
                first_rows.setdefault(s.id, table[s.slot].tolist())
    return seqs, first_rows


def _run_recording(engine: Engine, prompts, params):
    with jaxpaged.quiet_triton_deprecation():
        return engine.generate(prompts, params, record_prompt_logits=True)


BASE_PROMPT = _prompt(40, 51)  # two full pages and 8 tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_reuses_the_full_pages_of_a_prompts_prefix(backend):
    """One request at a time (steps one by one, prompt logits recorded): each prompt's full
    pages go to the cache; a prompt that starts with the same tokens starts on them, computes
    only the rest and gives what it gives without the cache. A page is keyed by its whole
    prefix: the same tokens after another first page miss. A prompt that is all cached pages
    still computes its last page, for its last token's logits."""
    cases = [  # prompt, pages looked up, pages found
        (BASE_PROMPT, 2, 0),
        (BASE_PROMPT + _prompt(30, 52), 4, 2),  # extends it: its two full pages hit
        (_prompt(PAGE, 53) + BASE_PROMPT[PAGE:], 2, 0),  # page 2 alike, page 1 not
        (BASE_PROMPT[: 2 * PAGE], 1, 1),  # page-aligned: the second page is computed again
        (BASE_PROMPT, 2, 2),
    ]
    require(backend)
    engine = _cached_engine(backend, decode_steps=None)
    plain = _engine(backend, decode_steps=None)
    for prompt, queried, hits in cases:
        params = SamplingParams(6, 0.8, seed=len(prompt))
        stats = dataclasses.replace(engine.stats)
        cached = engine.scheduler.cache.match(page_keys(prompt, PAGE)[:hits])
        [seq], first_rows = _run_checking_cached_pool(engine, [prompt], [params], record=True)
        assert engine.stats.prefix_queried_pages - stats.prefix_queried_pages == queried
        assert engine.stats.prefix_hit_pages - stats.prefix_hit_pages == hits
        assert engine.stats.prefill_tokens - stats.prefill_tokens == len(prompt) - hits * PAGE
        assert first_rows[seq.id][:hits] == cached
        [ref] = _run_recording(plain, [prompt], [params])
        _assert_same([seq], [ref])
        start = hits * PAGE  # positions taken from the cache have no logits
        assert np.isnan(seq.prompt_logits[:start]).all()
        np.testing.assert_allclose(
            seq.prompt_logits[start:], ref.prompt_logits[start:], rtol=0, atol=1e-5
        )
        np.testing.assert_allclose(seq.output_logits, ref.output_logits, rtol=0, atol=1e-5)
    assert engine.stats.prefix_hit_rate == 5 / 11
    # The pool holds only the cached pages: every prompt's full pages, once per prefix.
    assert engine.scheduler.cache.num_pages == 2 + 2 + 2
    assert _used_pages(engine) == 6


def test_prefix_cache_takes_the_pages_of_prompt_chunks_left_in_flight():
    """Prompt chunks that sample nothing stay in flight and are read after the next step is
    enqueued (`Engine._read_step`); the pages they filled go to the cache then, so a repeat
    of the prompt starts on all its full pages and gives what it gives without the cache."""
    prompt, params = _prompt(61, 70), SamplingParams(5, 0.8, seed=3)
    chunked = dict(chunk_size=8, max_tokens_per_step=8, xla_options=NO_GRAPHS)
    engine = _cached_engine(**chunked)
    full_pages = len(prompt) // PAGE
    seqs = []
    for _ in range(2):
        seqs.append(engine.add_request(prompt, params))
        while engine.has_work():
            engine.step()
    # The first run's prompt-only chunks stayed in flight (not the second's: it starts on
    # the cache and runs its last page in one step that samples).
    assert engine.stats.steps_in_flight >= full_pages * PAGE // 8 - 1
    assert len(engine.scheduler.cache.match(page_keys(prompt, PAGE))) == full_pages
    assert engine.stats.prefix_hit_pages == full_pages
    refs = _generate(_engine("xla", overlap=False), [prompt] * 2, params)
    _assert_same(seqs, refs)


def test_prefix_cache_evicts_the_least_recently_used_idle_pages():
    """On a 10-page pool, three finished 49-token prompts leave 9 idle cached pages; a new
    prompt that needs 3 pages evicts the two least recently used, the deepest pages of the
    oldest prompt first, so that its first page still hits and the other prompts all do."""
    prompts = [_prompt(3 * PAGE + 1, 60 + i) for i in range(3)]
    engine = _cached_engine(num_pages=10)
    for prompt in prompts:
        _run_checking_cached_pool(engine, [prompt], [SamplingParams(4)])
    cache = engine.scheduler.cache
    assert cache.num_pages == cache.num_idle == 9 and engine.stats.prefix_evicted_pages == 0
    _run_checking_cached_pool(engine, [_prompt(2 * PAGE + 1, 63)], [SamplingParams(4)])
    assert engine.stats.prefix_evicted_pages == 2
    assert [len(cache.match(page_keys(p, PAGE))) for p in prompts] == [1, 3, 3]
    [seq], _ = _run_checking_cached_pool(engine, prompts[:1], [SamplingParams(4)])
    assert engine.stats.prefix_hit_pages == 1
    _assert_same([seq], _generate(_engine("xla"), prompts[:1], SamplingParams(4)))


# Requests of up to 3 samples whose prompts start with one of three prefixes, cut at various
# lengths (some page-aligned), with their own tails.
_rng = np.random.default_rng(0)
_PREFIXES = [_prompt(n, 500 + n) for n in (20, 35, 50)]
CACHED_PROMPTS = [
    p[: int(_rng.integers(len(p) // 2, len(p) + 1))] + _prompt(int(_rng.integers(0, 20)), 900 + i)
    for i, p in enumerate(_PREFIXES[k] for k in _rng.integers(0, 3, 24))
]
CACHED_PARAMS = [
    SamplingParams(int(_rng.integers(4, 20)), 0.0 if i % 2 else 0.8, seed=i, n=int(n))
    for i, n in enumerate(_rng.choice([1, 1, 2, 3], 24))
]


@functools.cache
def _uncached_reference():
    return _generate(
        _engine("xla", decode_steps=None, num_pages=200), CACHED_PROMPTS, CACHED_PARAMS
    )


@pytest.mark.parametrize("decode_steps", [None, 8], ids=["steps", "blocks"])
def test_prefix_cache_on_a_small_pool_evicts_and_preempts_and_changes_no_output(decode_steps):
    """24 requests (38 samples) through a 10-page pool: prefixes hit, idle pages are evicted,
    sequences preempted (and recomputed from the cache), n-sample requests fork from cached
    prompts; after every step the pool and the scheduler agree, and every sample gives what it
    gives without the cache."""
    engine = _cached_engine(num_pages=10, decode_steps=decode_steps, chunk_size=32)
    seqs, _ = _run_checking_cached_pool(engine, CACHED_PROMPTS, CACHED_PARAMS)
    stats = engine.stats
    assert stats.prefix_hit_pages > 10 and stats.prefix_evicted_pages > 10
    assert engine.scheduler.num_preemptions > 0 and stats.forked_samples > 10
    if decode_steps is None:
        assert stats.failed_steps == 0
    _assert_same(_all_samples(seqs), _all_samples(_uncached_reference()))


def test_prefix_cache_recovers_when_the_scheduler_overbooks_the_pool():
    """With a scheduler that believes the pool is endless, steps fail on a pool full of cached
    pages; the engine evicts them, preempts and retries, and every sample is still right."""
    engine = _cached_engine(num_pages=10, chunk_size=32)
    engine.scheduler.num_pages = 10**6
    seqs = _generate(engine, CACHED_PROMPTS, CACHED_PARAMS)
    assert engine.stats.failed_steps > 0 and engine.stats.prefix_hit_pages > 0
    _assert_same(_all_samples(seqs), _all_samples(_uncached_reference()))


def test_prefix_cache_updates_compile_once():
    engine = _cached_engine(num_pages=10)
    # Warm-up as in the eviction test (prompts cached, one that evicts, one that hits), and
    # a fork, greedy and at temperature 0.8 (the sampling cases of the blocks below).
    cached = [_prompt(3 * PAGE + 1, 60 + i) for i in range(3)]
    for prompt in [*cached, _prompt(2 * PAGE + 1, 63), cached[0]]:
        _generate(engine, [prompt], SamplingParams(4))
    for temperature in (0.0, 0.8):
        _generate(engine, [_prompt(5, 64)], SamplingParams(3, temperature, n=2))
    assert engine.stats.prefix_hit_pages and engine.stats.prefix_evicted_pages
    with count_compilations() as compiles:
        _generate(engine, CACHED_PROMPTS[6:12], CACHED_PARAMS[6:12])
    assert not compiles, f"{len(compiles)} compilations after warm-up"


def test_pool_updates_compile_with_the_engine_and_change_nothing():
    """The pool updates the host schedules between steps compile before the first generation
    (the constructor runs `_compile_pool_updates` where steps run in command buffers, a GPU:
    a compile mid-generation evicts every executable's CUDA graphs, and the decode block after
    it ran op by op, ~20 ms at 16 rows, benchmarks/NOTES.md run 208). On padding ids they
    change no page and no slot; a generation that releases, forks, caches, hits and evicts
    then compiles none of them."""
    engine = _cached_engine(num_pages=11, decode_steps=8, chunk_size=32)  # no other test's
    before = jax.device_get((engine.kv_pages, engine.pool))
    engine._compile_pool_updates()
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get((engine.kv_pages, engine.pool)), before
    )
    with count_compilations() as compiles:
        _generate(engine, CACHED_PROMPTS[:12], CACHED_PARAMS[:12])
    updates = {f"jit({name})" for name in ("release", "fork_samples", "retain", "drop", "attach")}
    assert not updates & set(compiles), compiles
    # Names as JAX gives them; on a GPU the constructor compiled the steps too.
    assert "jit(block)" in compiles and ("jit(step)" in compiles) != (
        jax.default_backend() == "gpu"
    )
    stats = engine.stats
    assert stats.forked_samples and stats.prefix_hit_pages and stats.prefix_evicted_pages


def _one_token_prompt_beside_a_running_row(engine: Engine) -> list:
    """A 9-token prompt runs till it decodes; then a one-token prompt arrives: their next step
    is a plan of one-token chunks, one of them a prompt's."""
    seqs = [engine.add_request(_prompt(9, 1), SamplingParams(12))]
    while not seqs[0].output:
        engine.step()
    seqs.append(engine.add_request([7], SamplingParams(6)))
    while engine.has_work():
        engine.step()
    return seqs


def test_one_token_chunks_beside_blocks_run_in_the_mixed_kind():
    """With blocks on, a plan of one-token chunks that are not all decode tokens (a one-token
    prompt, or a prompt's last token, beside decode rows) runs in the mixed kind: the decode
    step kind would compile for that plan alone, mid-generation (26 s at 16 rows on the H200,
    benchmarks/NOTES.md run 213). The tokens are the per-step engine's."""
    engine = _engine("xla", decode_steps=4)
    kinds, step_fn = [], engine.step_fn  # the kinds the engine's steps ask for: decode or not
    engine.step_fn = lambda decode, **kwargs: kinds.append(decode) or step_fn(decode, **kwargs)
    with jaxpaged.quiet_triton_deprecation():
        seqs = _one_token_prompt_beside_a_running_row(engine)
        refs = _one_token_prompt_beside_a_running_row(_engine("xla", decode_steps=None))
    assert kinds and not any(kinds) and engine.stats.blocks > 0
    _assert_same(seqs, refs)


def test_prompt_chunks_run_ahead_of_their_reads():
    """Steps of prompt chunks that sample nothing (here the first prompt's, alone in their
    steps) are enqueued before the step before them is read (one in flight at a time); the
    tokens and log-probabilities are those of the engine
    that reads every step before planning the next."""
    prompts = [_prompt(n, 300 + n) for n in (61, 7, 44, 29)]
    params = [SamplingParams(6 + i, 0.0 if i % 2 else 0.8, seed=i) for i in range(4)]
    engine = _engine("xla", chunk_size=8, max_tokens_per_step=8, xla_options=NO_GRAPHS)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    ahead = 0
    while engine.has_work():
        engine.step()
        ahead += engine._step is not None
        assert engine._step is None or not any(c.samples for c in engine._step.plan.chunks)
    assert ahead > 4 and engine.stats.steps_in_flight == ahead
    ref = _engine("xla", chunk_size=8, max_tokens_per_step=8, overlap=False)
    _assert_same(seqs, _generate(ref, prompts, params))
    assert ref.stats.steps_in_flight == 0


def test_a_failed_step_in_flight_is_taken_back():
    """A prompt chunk left in flight whose reservation fails (its pages taken on the device
    behind the scheduler's back, and given back before the next step): the step enqueued after
    it runs nothing (its guard: the pool's cached count is not the host's), the host takes
    both chunks back and preempts, and the request gives what it gives alone."""
    prompt, params = _prompt(61, 500), SamplingParams(5)
    engine = _engine("xla", chunk_size=8, max_tokens_per_step=8, xla_options=NO_GRAPHS)
    seq = engine.add_request(prompt, params)
    engine.step()
    engine.step()  # tokens 8-16 in flight, 0-8 read
    assert engine._step is not None and seq.num_cached == 16
    taken = engine.pool.refcount == 0
    engine.pool = dataclasses.replace(engine.pool, refcount=engine.pool.refcount + taken)
    engine.step()  # tokens 16-24, which need a page, in flight
    engine.pool = dataclasses.replace(engine.pool, refcount=engine.pool.refcount - taken)
    # Tokens 24-32 in flight: the pool has pages again, but holds 16 tokens, not 24. Then
    # 16-24 read: failed, and so did 24-32.
    engine.step()
    assert engine.stats.failed_steps == 2 and engine._step is None
    assert seq.num_cached == 0 and seq in engine.scheduler.waiting
    while engine.has_work():
        engine.step()
    _check_pool(engine)
    [ref] = _generate(_engine("xla", decode_steps=None, overlap=False), [prompt], params)
    _assert_same([seq], [ref])


def test_steps_stay_in_flight_only_outside_command_buffers():
    """On a GPU a decode or mixed step that runs in a command buffer is read before the next
    is enqueued (its next launch waited for it); without command buffers, and off the GPU, it
    may stay in flight. Prompt-only steps always may: on a GPU in two copies that take
    turns. Every kind checks the host's counts (`model_step`): any step may be enqueued
    behind one in flight."""
    engine = _engine("xla", xla_options=NO_GRAPHS)
    assert engine._may_stay == {True: True, False: True}
    graphs = _engine("xla", xla_options=SMALL_STEP_XLA_OPTIONS)._may_stay
    assert graphs == {k: jax.default_backend() != "gpu" for k in (True, False)}
    assert uses_command_buffers(SMALL_STEP_XLA_OPTIONS) and uses_command_buffers(())
    assert not uses_command_buffers(NO_GRAPHS)
    # The mixed steps that may stay in flight: a prompt-only kind of their own, on a GPU in
    # two copies that take turns.
    engine = _engine("xla", xla_options=SMALL_STEP_XLA_OPTIONS)
    treedef = jax.tree.structure(engine.params)
    on_gpu = jax.default_backend() == "gpu"
    copies = [
        step_function(engine.graphdef, treedef, SMALL_STEP_XLA_OPTIONS, prompt_only=True, copy=i)
        for i in range(2 if on_gpu else 1)
    ]
    assert len(set(map(id, copies))) == len(copies)
    turns = [engine.step_fn(False, in_flight=True, turn=t) for t in range(4)]
    assert turns == (copies * 4)[:4]
    checked = functools.partial(step_function, engine.graphdef, treedef, SMALL_STEP_XLA_OPTIONS)
    assert engine.step_fn(False) is checked()
    assert engine.step_fn(True) is checked()


def _recorded(engine: Engine, events: list[str]) -> None:
    """Make `engine` log its reads of steps in flight and its calls of the mixed kind and the
    prompt-only copies into `events`."""

    def recorded(name, fn):
        return lambda *a, **kw: events.append(name) or fn(*a, **kw)

    read_step = engine._read_step
    engine._read_step = lambda step, **kw: events.append("read") or read_step(step, **kw)
    engine._mixed_fns = {n: recorded("mixed", fn) for n, fn in engine._mixed_fns.items()}
    engine._prompt_fns = tuple(recorded(f"copy {i}", fn) for i, fn in enumerate(engine._prompt_fns))


def test_prompt_chunks_stay_in_flight_in_copies_that_take_turns():
    """Where mixed steps run in command buffers (on a GPU), steps of prompt chunks that sample
    nothing stay in flight in the prompt-only kind, two copies of it in turn (a command
    buffer's launch waits for its own launch in flight); the chunk that samples runs in the
    mixed kind, enqueued before the step in flight is read, so that its launch overlaps the
    GPU's work."""
    prompt, params = _prompt(28, 700), SamplingParams(4)
    engine = _engine("xla", chunk_size=8, max_tokens_per_step=8, decode_steps=None)
    engine._may_stay[False] = False  # mixed steps as if they ran in command buffers
    treedef = jax.tree.structure(engine.params)
    engine._prompt_fns = tuple(
        step_function(engine.graphdef, treedef, (), prompt_only=True, copy=i) for i in range(2)
    )
    assert engine._prompt_fns[0] is not engine._prompt_fns[1]
    events = []
    _recorded(engine, events)
    seq = engine.add_request(prompt, params)
    for _ in range(4):  # tokens 0-8, 8-16 and 16-24 in flight in turn, then 24-28 (it samples)
        engine.step()
    assert events == ["copy 0", "copy 1", "read", "copy 0", "read", "mixed", "read"]
    assert engine._step is None and engine.stats.steps_in_flight == 3
    while engine.has_work():
        engine.step()
    [ref] = _generate(_engine("xla", decode_steps=None, overlap=False), [prompt], params)
    _assert_same([seq], [ref])


def test_a_step_that_samples_behind_a_failed_step_in_flight_runs_nothing():
    """The chunk that samples, enqueued behind a prompt chunk in flight whose reservation
    fails, runs nothing (the pool's cached count is not the host's): both are taken back, the
    request is preempted once (not once per failed step) and gives what it gives alone."""
    prompt, params = _prompt(2 * PAGE + 4, 800), SamplingParams(3)
    engine = _engine("xla", chunk_size=PAGE, max_tokens_per_step=PAGE, decode_steps=None)
    events = []
    _recorded(engine, events)
    seq = engine.add_request(prompt, params)
    engine.step()  # tokens 0-PAGE in flight
    taken = engine.pool.refcount == 0
    engine.pool = dataclasses.replace(engine.pool, refcount=engine.pool.refcount + taken)
    engine.step()  # tokens PAGE to 2 PAGE, which need a page, in flight; 0-PAGE read
    engine.pool = dataclasses.replace(engine.pool, refcount=engine.pool.refcount - taken)
    # The last four tokens (they sample) enqueued, then PAGE to 2 PAGE read: failed, and so
    # did the step behind it.
    engine.step()
    copies = len(engine._prompt_fns)  # two on a GPU, in turn
    assert events == ["copy 0", f"copy {1 % copies}", "read", "mixed", "read"]
    assert engine.stats.failed_steps == 2 and engine._step is None
    assert engine.scheduler.num_preemptions == 1 and seq in engine.scheduler.waiting
    assert seq.num_cached == 0 and not seq.output
    while engine.has_work():
        engine.step()
    _check_pool(engine)
    [ref] = _generate(_engine("xla", decode_steps=None, overlap=False), [prompt], params)
    _assert_same([seq], [ref])


def test_prompt_only_steps_sample_nothing_and_skip_the_decode_token_launch():
    """The kind that a step of prompt chunks stays in flight in has no vocabulary projection
    or sampling (its tokens, logprobs and logits are None) and one ragged-attention launch a
    layer where the mixed kind has two (the second takes decode tokens)."""
    engine = _engine("triton", chunk_size=8, max_tokens_per_step=8, decode_steps=None)
    engine.add_request(_prompt(20, 1), SamplingParams(4))
    plan = engine.scheduler.schedule()
    assert plan.chunks and not any(c.samples for c in plan.chunks)
    args = (engine.param_leaves, engine.kv_pages, engine.pool, engine._inputs(plan, decode=False))
    options = dict(decode=False, all_logits=False, implementation="triton")
    with jaxpaged.quiet_triton_deprecation():
        mixed, prompt_only = (
            engine.step_fn(False, in_flight=in_flight).trace(*args, **options)
            for in_flight in (False, True)
        )
    out = prompt_only.out_info[2]
    assert out.tokens is None and out.logprobs is None and out.logits is None
    assert mixed.out_info[2].tokens is not None
    # The Triton kernel's launches: "_short" takes the sequences of a few tokens.
    launches = [
        set(re.findall(r"name=(ragged_paged_prefill\w*)", str(t.jaxpr)))
        for t in (mixed, prompt_only)
    ]
    assert launches == [
        {"ragged_paged_prefill", "ragged_paged_prefill_short"},
        {"ragged_paged_prefill"},
    ]
