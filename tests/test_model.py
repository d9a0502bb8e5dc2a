"""The decoder and its engine: chunked prefill equals single-shot prefill, batching and pool
pressure change no result, steps compile once and update the pages in place.

Float32 tests run the seeded random decoder on random prompts: its attention is spread over
every key, so a key missing or read twice moves the logits. The bfloat16 greedy test runs the
induction decoder (`tests/induction.py`) on repeated segments: its predictions are confident
(top-1/top-2 logit margins of 3.7 and more), far above the bf16 roundings in which chunked and
single-shot prefill differ (~0.01), and they come from attention to earlier chunks.

Every body runs for each backend: "xla" and "triton" (Pallas interpret mode) here on a covering
subset, and the whole matrix with compiled kernels under the `gpu` marker.
"""

import dataclasses
import functools
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpaged
from models import generate
from models.config import CONFIGS, EngineConfig
from models.decoder import MLP, SWIGLU_F32_MAX_TOKENS, Decoder, split_gate_up
from models.engine import (
    EXHAUSTIVE_TILING,
    LARGE_STEP_XLA_OPTIONS,
    SMALL_STEP_XLA_OPTIONS,
    Engine,
    step_function,
    step_xla_options,
)
from models.scheduler import Chunk, Plan, SamplingParams, Sequence
from tests.helpers import GPU_BACKENDS, backend_params, count_compilations, require
from tests.induction import BOS, induction_decoder, induction_prompt

PAGE = 16
# One engine shape for most tests, so that they share compiled steps: a 300-token prompt plus
# 32 new tokens fits one sequence; 24 pages do not hold the pool test's requests at once.
BASE = EngineConfig(
    page_size=PAGE, num_pages=24, max_seqs=4, max_tokens_per_step=64, max_model_len=352
)
SINGLE_SHOT_BUDGET = 320  # the budget of a step that prefills a 300-token prompt at once

# Chunked against single-shot prefill, float32 logits (magnitude ~5): the two runs compute the
# same per-token math; only how the work is split differs. The XLA reference gathers the same
# keys in the same order for every token, so only matmul blocking over different row offsets
# moves the result (~1e-6); the kernels also split the online softmax over different KV tiles
# when a chunk starts inside one, which reorders float32 sums (relative ~1e-6 per layer).
# Summed over the layers and the vocabulary projection that stays below ~1e-5: 1e-4.
F32_LOGIT_TOL = 1e-4
# bfloat16: greedy tokens must agree exactly and the chosen tokens' log-probabilities may drift
# by the bf16 roundings the two splits apply at different places: 0.01 nats on average.
BF16_LOGPROB_TOL = 0.01

PROMPT_LENS = [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 5, 300]
CHUNKS = [1, 7, PAGE, 64]


def _cases(cpu: dict[str, list[tuple[int, int]]]):
    """(backend, prompt_len, chunk) params: the CPU subsets, and on the GPU every chunk shorter
    than the prompt (single-shot prefill, the whole prompt as one chunk, is the other side)."""
    cases = [
        pytest.param(b, p, c, id=f"{b}-p{p}-c{c}") for b, pairs in cpu.items() for p, c in pairs
    ]
    cases += [
        pytest.param(b, p, c, id=f"{name}-p{p}-c{c}", marks=pytest.mark.gpu)
        for b, name in GPU_BACKENDS
        for p, c in itertools.product(PROMPT_LENS, CHUNKS)
        if c < p or p == 1
    ]
    return cases


@functools.cache
def _model(dtype, induction: bool = False) -> Decoder:
    config = CONFIGS["tiny"].with_dtype(dtype)
    return induction_decoder(config) if induction else Decoder(config, rngs=nnx.Rngs(0))


def _engine(backend, dtype=jnp.float32, induction: bool = False, **changes) -> Engine:
    return Engine(
        _model(dtype, induction), dataclasses.replace(BASE, **changes), implementation=backend
    )


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, CONFIGS["tiny"].vocab_size, length).tolist()


def _task_prompt(length: int) -> list[int]:
    """A prompt of the induction decoder's task: at least two copies of a segment of up to 24
    tokens, so that its continuation is determined."""
    period = min(24, max(1, (length - 1) // 2))
    return induction_prompt(length, period, 0, CONFIGS["tiny"].vocab_size)


def _run(engine: Engine, prompts, params) -> list[Sequence]:
    with jaxpaged.quiet_triton_deprecation():
        return engine.generate(prompts, params, record_prompt_logits=True)


@functools.cache
def _single_shot(backend, dtype, prompt_len: int, max_new: int, induction: bool = False):
    budget = (
        BASE.max_tokens_per_step if prompt_len <= BASE.max_tokens_per_step else (SINGLE_SHOT_BUDGET)
    )
    engine = _engine(backend, dtype, induction, max_tokens_per_step=budget)
    prompt = _task_prompt(prompt_len) if induction else _prompt(prompt_len)
    [seq] = _run(engine, [prompt], SamplingParams(max_new))
    assert engine.stats.steps == max_new  # the prompt took one step
    return seq


def _chunked(backend, dtype, prompt_len: int, chunk: int, max_new: int, induction: bool = False):
    prompt = _task_prompt(prompt_len) if induction else _prompt(prompt_len)
    [seq] = _run(
        _engine(backend, dtype, induction, chunk_size=chunk), [prompt], SamplingParams(max_new)
    )
    return seq


CPU_F32 = {
    "xla": [(1, 1)] + [(p, c) for p, c in itertools.product(PROMPT_LENS, CHUNKS) if c < p],
    "triton": [(PAGE + 1, 7), (3 * PAGE + 5, PAGE), (PAGE - 1, 1)],
}


@pytest.mark.parametrize(("backend", "prompt_len", "chunk"), _cases(CPU_F32))
def test_chunked_prefill_then_decode_matches_single_shot_f32(backend, prompt_len, chunk):
    """Every prompt position's logits, the greedy continuation and its log-probabilities."""
    require(backend)
    ref = _single_shot(backend, jnp.float32, prompt_len, 8)
    seq = _chunked(backend, jnp.float32, prompt_len, chunk, 8)
    assert np.isfinite(ref.prompt_logits).all() and np.isfinite(seq.prompt_logits).all()
    np.testing.assert_allclose(seq.prompt_logits, ref.prompt_logits, rtol=0, atol=F32_LOGIT_TOL)
    assert seq.output == ref.output
    np.testing.assert_allclose(seq.logprobs, ref.logprobs, rtol=0, atol=F32_LOGIT_TOL)
    assert len(seq.output_logits) == len(seq.output)
    np.testing.assert_array_equal(seq.output_logits[0], seq.prompt_logits[-1])
    np.testing.assert_allclose(seq.output_logits, ref.output_logits, rtol=0, atol=F32_LOGIT_TOL)


CPU_BF16 = {
    "xla": [(PAGE, 1), (PAGE + 1, 7), (3 * PAGE + 5, PAGE), (300, 64)],
    "triton": [(3 * PAGE + 5, PAGE)],
}


def _top2(logits: np.ndarray) -> str:
    second, first = np.argsort(logits)[-2:]
    return (
        f"top-1 {first} ({logits[first]:.4f}), top-2 {second} ({logits[second]:.4f}), "
        f"margin {logits[first] - logits[second]:.4f}"
    )


def _margins(logits: list[np.ndarray]) -> list[float]:
    """Each row's top-1 minus top-2 logit."""
    return [float(np.subtract(*np.sort(x)[:-3:-1])) for x in logits]


def _greedy_report(seq: Sequence, ref: Sequence) -> str:
    """Where two greedy runs part: the first differing step with both runs' top-2 logits there,
    the smallest top-1/top-2 margin of the reference before it, and the log-probability and
    logit drift."""
    diverge = next(
        (i for i, (a, b) in enumerate(zip(seq.output, ref.output, strict=True)) if a != b), None
    )
    same = len(ref.output) if diverge is None else diverge
    dlp = np.abs(np.subtract(seq.logprobs[:same], ref.logprobs[:same]))
    dlogit = np.abs(np.subtract(seq.output_logits[:same], ref.output_logits[:same]))
    lines = [
        f"mean |dlogprob| {np.mean(dlp) if same else 0:.4g}, max {np.max(dlp, initial=0):.4g} "
        f"over the {same} agreeing steps (all 32: "
        f"{np.mean(np.abs(np.subtract(seq.logprobs, ref.logprobs))):.4g}); "
        f"max |dlogit| there {np.max(dlogit, initial=0):.4g}",
        "reference's smallest top-1/top-2 margin there: "
        f"{min(_margins(ref.output_logits[:same]), default=np.inf):.4g}",
    ]
    if diverge is not None:
        a, b = seq.output_logits[diverge], ref.output_logits[diverge]
        lines += [
            f"first differing step {diverge}: chunked {seq.output[diverge]}, single-shot "
            f"{ref.output[diverge]}",
            f"  chunked:     {_top2(a)}",
            f"  single-shot: {_top2(b)}",
            f"  max |dlogit| there {np.max(np.abs(a - b)):.4g}",
        ]
    return "\n".join(lines)


# The Mosaic path on the GPU: Mosaic attention and the Mosaic GPU `rope_append` (the auto path
# runs the Triton one), on a few of the shapes.
MOSAIC_BF16 = [
    pytest.param("mosaic", p, c, id=f"mosaic-gpu-p{p}-c{c}", marks=pytest.mark.gpu)
    for p, c in ((1, 1), (PAGE + 1, 7), (3 * PAGE + 5, PAGE), (300, 64))
]


@pytest.mark.parametrize(("backend", "prompt_len", "chunk"), _cases(CPU_BF16) + MOSAIC_BF16)
def test_chunked_prefill_greedy_continuation_bf16(backend, prompt_len, chunk):
    require(backend)
    ref = _single_shot(backend, jnp.bfloat16, prompt_len, 32, induction=True)
    seq = _chunked(backend, jnp.bfloat16, prompt_len, chunk, 32, induction=True)
    report = _greedy_report(seq, ref)
    print(report)  # shown with -rA or -s, also when the test passes
    assert seq.output == ref.output, report
    assert np.mean(np.abs(np.subtract(seq.logprobs, ref.logprobs))) <= BF16_LOGPROB_TOL, report


@pytest.mark.parametrize(("backend", "prompt_len", "chunk"), _cases(CPU_BF16))
def test_chunked_prefill_prompt_logprobs_bf16(backend, prompt_len, chunk):
    """The bf16 rounding drift itself, on the random decoder (whose spread attention shows
    it): the log-probability of each prompt's next token, teacher-forced, after chunked and
    after single-shot prefill, differs by at most 0.01 nats on average. Greedy tokens are not
    compared here: the random decoder's near-ties make them flip under any drift."""
    require(backend)
    if prompt_len < 2:
        pytest.skip("a one-token prompt predicts no prompt token")
    ref = _single_shot(backend, jnp.bfloat16, prompt_len, 32)
    seq = _chunked(backend, jnp.bfloat16, prompt_len, chunk, 32)
    targets = np.asarray(_prompt(prompt_len)[1:])[:, None]

    def logprobs(s: Sequence) -> np.ndarray:
        logits = s.prompt_logits[:-1].astype(np.float64)
        assert np.isfinite(logits).all()
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        return np.take_along_axis(shifted - log_z, targets, axis=1)[:, 0]

    drift = np.abs(logprobs(seq) - logprobs(ref))
    print(f"mean |dlogprob| {drift.mean():.4g}, max {drift.max():.4g}")
    assert drift.mean() <= BF16_LOGPROB_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_swiglu_rounds_once_in_decode_sized_steps(dtype):
    """Up to `SWIGLU_F32_MAX_TOKENS` tokens the MLP takes `silu(gate) * up` from the float32
    gate/up product and rounds once; above, from the product rounded to the model's dtype
    (half the bytes at prefill sizes). In float32 the two are the same computation."""
    config = dataclasses.replace(CONFIGS["tiny"], dtype=dtype)
    mlp = MLP(config, rngs=nnx.Rngs(3))
    kernel = mlp.gate_up_proj.kernel[...]

    def rounded_first(x):
        gate, up = split_gate_up(x @ kernel)
        return mlp.down_proj(jax.nn.silu(gate) * up)

    def rounded_once(x):
        gate, up = split_gate_up(jnp.dot(x, kernel, preferred_element_type=jnp.float32))
        return mlp.down_proj((jax.nn.silu(gate) * up).astype(dtype))

    for rows, want in (
        (SWIGLU_F32_MAX_TOKENS, rounded_once),
        (SWIGLU_F32_MAX_TOKENS + 1, rounded_first),
    ):
        x = jax.random.normal(jax.random.key(rows), (rows, config.hidden_size), dtype)
        got = mlp(x)
        assert got.dtype == dtype and bool(jnp.all(jnp.isfinite(got)))
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want(x), np.float32))
        if dtype == jnp.bfloat16:  # the two roundings differ somewhere in a bf16 step
            other = rounded_first if want is rounded_once else rounded_once
            assert not np.array_equal(np.asarray(got, np.float32), np.asarray(other(x), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mlp_partial_sums_in_small_steps(dtype):
    """With `partial_sums`, a step of at most `DECODE_OUTPUT_SPLIT_K_MAX_TOKENS` tokens gets
    the down projection as float32 partial sums [S, T, hidden] that add up to the MLP's
    output; a larger step gets the output itself."""
    config = dataclasses.replace(CONFIGS["tiny"], dtype=dtype)
    mlp = MLP(config, rngs=nnx.Rngs(3))
    small = jaxpaged.layers.DECODE_OUTPUT_SPLIT_K_MAX_TOKENS
    for rows in (3, small + 1):
        x = jax.random.normal(jax.random.key(rows), (rows, config.hidden_size), dtype)
        want = np.asarray(mlp(x), np.float64)
        got = mlp(x, partial_sums=True)
        if rows > small:
            np.testing.assert_array_equal(np.asarray(got, np.float64), want)
            continue
        assert got.dtype == jnp.float32
        assert got.shape == (jaxpaged.layers.DECODE_OUTPUT_SPLIT_K, rows, config.hidden_size)
        summed = np.asarray(got.sum(0), np.float64)
        assert np.isfinite(summed).all()
        # float32: another summation order (~1e-6 of values ~1). bfloat16: the MLP's own output
        # is rounded (2^-9 relative) where the partials are not.
        tol = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}[dtype]
        np.testing.assert_allclose(summed, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_induction_decoder_continues_from_earlier_chunks(dtype):
    """The bf16 test's model, on a 53-token prompt prefilled in chunks of 16, continues its
    24-token segment with large margins. With every token before the last chunk replaced it
    does not: the continuation comes from attention to earlier chunks, so a mask that hid
    them would change it."""
    prompt, period = _task_prompt(3 * PAGE + 5), 24
    expected = np.resize(prompt[1 : period + 1], len(prompt) - 1 + 32)[len(prompt) - 1 :]
    others = np.setdiff1d(np.arange(1, CONFIGS["tiny"].vocab_size), prompt)
    replaced = np.random.default_rng(1).choice(others, 3 * PAGE - 1, replace=False).tolist()
    hidden = [BOS, *replaced, *prompt[3 * PAGE :]]
    engine = _engine("xla", dtype, induction=True, chunk_size=PAGE)
    seq, unseen = _run(engine, [prompt, hidden], SamplingParams(32))
    accuracy = np.mean(np.equal(seq.output, expected))
    unseen_accuracy = np.mean(np.equal(unseen.output, expected))
    margin = min(_margins(seq.output_logits))
    print(
        f"accuracy {accuracy:.3f}, smallest top-1/top-2 margin {margin:.3f}; "
        f"earlier chunks replaced: accuracy {unseen_accuracy:.3f}"
    )
    assert accuracy >= 0.9 and margin >= 1.0
    assert unseen_accuracy <= 0.1


# Four requests with greedy and seeded sampling; with a budget of 32 tokens and chunks of 16
# their prefill chunks share steps with each other's decodes.
MIXED_PROMPTS = [_prompt(37, 1), _prompt(5, 2), _prompt(70, 3), _prompt(PAGE, 4)]
MIXED_PARAMS = [
    SamplingParams(12),
    SamplingParams(12, 0.8, seed=1),
    SamplingParams(9),
    SamplingParams(12, 1.0, seed=7),
]


def _assert_same_results(seqs, refs):
    for seq, ref in zip(seqs, refs, strict=True):
        assert seq.output == ref.output
        np.testing.assert_allclose(seq.logprobs, ref.logprobs, rtol=0, atol=F32_LOGIT_TOL)
        np.testing.assert_allclose(seq.prompt_logits, ref.prompt_logits, rtol=0, atol=F32_LOGIT_TOL)


def _alone(backend, prompts, params) -> list[Sequence]:
    return [_run(_engine(backend), [p], sp)[0] for p, sp in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("backend", backend_params())
def test_interleaved_sequences_equal_each_run_alone(backend):
    require(backend)
    engine = _engine(backend, max_tokens_per_step=32, chunk_size=PAGE)
    seqs = _run(engine, MIXED_PROMPTS, MIXED_PARAMS)
    # Some tokens were sampled in mixed steps beyond each prompt's first: decodes rode along.
    generated = sum(len(s.output) for s in seqs)
    assert generated - len(seqs) > engine.stats.decode_tokens
    _assert_same_results(seqs, _alone(backend, MIXED_PROMPTS, MIXED_PARAMS))


def _check_pool(engine: Engine) -> None:
    """Each page's refcount is the number of slots that hold it (so free pages are exactly the
    unheld ones), and the pool's lengths are the scheduler's."""
    pool = jax.device_get(engine.pool)
    held = np.concatenate([pool.page_indices[s, :n] for s, n in enumerate(pool.num_owned)])
    np.testing.assert_array_equal(pool.refcount, np.bincount(held, minlength=pool.num_pages))
    for seq in engine.scheduler.running:
        assert pool.kv_lens[seq.slot] == seq.num_cached
        assert pool.num_owned[seq.slot] == -(-seq.num_cached // PAGE)


def _cached_kv(engine: Engine, seq: Sequence) -> list[np.ndarray]:
    """Every layer's K and V of the sequence's cached positions, gathered through its pages."""
    table = np.asarray(engine.pool.page_indices[seq.slot])
    pos = np.arange(seq.num_cached)
    return [
        np.asarray(pages)[table[pos // PAGE], pos % PAGE]
        for layer in engine.kv_pages
        for pages in layer
    ]


POOL_PROMPTS = [_prompt(n, 10 + n) for n in (90, 70, 100, 60, 80)]
POOL_PARAMS = [SamplingParams(24, 0.0 if i % 2 else 0.7, seed=i) for i in range(5)]


@pytest.mark.parametrize("backend", backend_params())
def test_pool_exhaustion_waits_and_preempts_without_corruption(backend):
    """The requests need 35 pages, the pool has 24: they wait and get preempted, and every one
    still gives what it gives alone. After each step the pool is consistent and every running
    sequence's cached K/V are bitwise what they were."""
    require(backend)
    engine = _engine(backend, chunk_size=32)
    seqs = [engine.add_request(p, sp) for p, sp in zip(POOL_PROMPTS, POOL_PARAMS, strict=True)]
    waited_for_pages = False
    with jaxpaged.quiet_triton_deprecation():
        while engine.scheduler.has_work():
            before = {s.id: (s.slot, _cached_kv(engine, s)) for s in engine.scheduler.running}
            engine.step(record_prompt_logits=True)
            _check_pool(engine)
            # A request waits with a slot free: the pool, not the slots, holds it back.
            waited_for_pages |= bool(engine.scheduler.waiting and engine.scheduler.free_slots)
            for s in engine.scheduler.running:
                if s.id in before and before[s.id][0] == s.slot:
                    for old, new in zip(before[s.id][1], _cached_kv(engine, s), strict=True):
                        np.testing.assert_array_equal(new[: len(old)], old)
    assert engine.scheduler.num_preemptions > 0 and waited_for_pages
    assert engine.stats.failed_steps == 0  # the scheduler's page accounting matches the pool's
    assert np.asarray(engine.pool.free).all()  # finished sequences released their pages
    _assert_same_results(seqs, _alone(backend, POOL_PROMPTS, POOL_PARAMS))


def test_failed_reservation_writes_nothing():
    """A step whose pages the pool cannot hold returns ok=False and leaves pages and pool as
    they were: the running sequence's cache is not touched."""
    engine = _engine("xla")
    seq = engine.add_request(_prompt(40), SamplingParams(4))
    engine.step()
    # Another slot takes all but one free page; the next step needs three.
    engine.pool, ok = jaxpaged.reserve(engine.pool, jnp.asarray([3]), jnp.asarray([20 * PAGE]))
    assert bool(ok) and int(jaxpaged.num_free_pages(engine.pool)) == 1
    newcomer = Sequence(99, _prompt(40, 1), 40, SamplingParams(4), slot=1)
    plan = Plan([Chunk(seq, seq.num_cached, 1), Chunk(newcomer, 0, 40)])
    before = jax.device_get((engine.kv_pages, engine.pool))
    kv_pages, pool, out = engine.step_fn(False)(
        engine.param_leaves,
        engine.kv_pages,
        engine.pool,
        engine._inputs(plan, decode=False),
        decode=False,
        all_logits=False,
        implementation="xla",
    )
    assert not bool(out.ok)
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves((kv_pages, pool)), strict=True):
        np.testing.assert_array_equal(np.asarray(new), old)


def test_engine_recovers_from_failed_reservations():
    """With a scheduler that believes the pool is endless, only `reserve`'s ok stops steps that
    do not fit; the engine preempts and retries, and the results are still right."""
    engine = _engine("xla", chunk_size=32)
    engine.scheduler.num_pages = 10**6
    seqs = _run(engine, POOL_PROMPTS, POOL_PARAMS)
    assert engine.stats.failed_steps > 0
    _assert_same_results(seqs, _alone("xla", POOL_PROMPTS, POOL_PARAMS))


def test_steps_do_not_recompile_after_warm_up():
    engine = _engine("xla")
    # A mixed, a prompt-only (the first 64 tokens of 100) and a decode step.
    _run(engine, [_prompt(100), _prompt(3)], SamplingParams(4))
    with count_compilations() as compiles:
        _run(
            engine,
            [_prompt(n, n) for n in (1, 17, 90, 5, 63)],
            [
                SamplingParams(m, t, seed=m)
                for m, t in ((3, 0.0), (9, 1.0), (2, 0.5), (6, 0.0), (4, 0.0))
            ],
        )
    assert not compiles, f"{len(compiles)} compilations after warm-up"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
def test_step_updates_pages_and_pool_in_place(backend, decode):
    """The compiled step aliases every page array and pool array to its output, copies no page
    array, and the buffers passed in are consumed."""
    require(backend)
    engine = _engine(backend)
    seq = engine.add_request(_prompt(20), SamplingParams(2))
    plan = engine.scheduler.schedule()
    if decode:
        engine.step()
        plan = engine.scheduler.schedule()
    assert plan.decode == decode and plan.chunks[0].seq is seq
    step = engine.step_fn(decode)
    args = (engine.param_leaves, engine.kv_pages, engine.pool, engine._inputs(plan, decode))
    options = dict(decode=decode, all_logits=False, implementation=backend)
    with jaxpaged.quiet_triton_deprecation():
        compiled = step.lower(*args, **options).compile()
    state = jax.tree.leaves((engine.kv_pages, engine.pool))
    assert compiled.memory_analysis().alias_size_in_bytes >= sum(x.nbytes for x in state)
    hlo = compiled.as_text()
    aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}", hlo.splitlines()[0])}
    first = len(jax.tree.leaves(engine.params))
    assert set(range(first, first + len(state))) <= aliased
    page_shape = f"f32[{','.join(map(str, engine.kv_pages[0][0].shape))}]"
    assert not re.search(re.escape(page_shape) + r"\{[\d,]+\} copy\(", hlo), "a page copy"
    old = engine.kv_pages[0][0]
    with jaxpaged.quiet_triton_deprecation():
        engine.kv_pages, engine.pool, _ = step(*args, **options)
    assert old.is_deleted()


def test_demo_prints_json(capsys):
    generate.main(
        [
            "--config",
            "tiny",
            "--prompt-len",
            "20",
            "--chunk-size",
            "7",
            "--max-new-tokens",
            "3",
            "--implementation",
            "xla",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert result["implementation"] == "xla" and result["tokens_match"] is True
    assert 0 <= result["max_abs_logit_diff"] <= F32_LOGIT_TOL
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0


def test_small_steps_get_command_buffers_and_large_ones_do_not():
    """The XLA options rule of `step_xla_options` (measured in benchmarks/NOTES.md), and
    the engine's step kinds compiled by it: decode steps (max_seqs tokens), mixed steps that
    sample (each of `step_token_counts`) and prompt-only steps (max_tokens_per_step) each by
    their own token count and kind."""
    # Steps read at once: command buffers up to 2048 tokens (run 220), op by op above.
    assert step_xla_options(1) == step_xla_options(2048) == SMALL_STEP_XLA_OPTIONS
    assert step_xla_options(2049) == step_xla_options(4096) == LARGE_STEP_XLA_OPTIONS
    # Prompt-only steps, which stay in flight: up to 512 tokens.
    assert step_xla_options(512, prompt_only=True) == SMALL_STEP_XLA_OPTIONS
    assert step_xla_options(513, prompt_only=True) == LARGE_STEP_XLA_OPTIONS
    assert step_xla_options(513, graphs_up_to=512) == LARGE_STEP_XLA_OPTIONS
    assert step_xla_options(4096, prompt_only=True, graphs_up_to=4096) == SMALL_STEP_XLA_OPTIONS
    assert step_xla_options(8, decode=True) == step_xla_options(8) == SMALL_STEP_XLA_OPTIONS
    # Decode from 16 rows adds the exhaustive GEMM tiling search (runs 192-193), nothing else.
    assert step_xla_options(15, decode=True) == SMALL_STEP_XLA_OPTIONS
    assert step_xla_options(16, decode=True) == SMALL_STEP_XLA_OPTIONS + EXHAUSTIVE_TILING
    assert step_xla_options(16) == SMALL_STEP_XLA_OPTIONS
    assert step_xla_options(600, decode=True) == SMALL_STEP_XLA_OPTIONS + EXHAUSTIVE_TILING
    assert step_xla_options(3000, decode=True) == LARGE_STEP_XLA_OPTIONS + EXHAUSTIVE_TILING
    decode = dict(step_xla_options(64, decode=True))
    assert decode["xla_gpu_exhaustive_tiling_search"] is True
    assert "WHILE" in decode["xla_gpu_enable_command_buffer"]
    # CUB's sort is a custom call no command buffer takes: it would leave the loop to the host.
    assert decode["xla_gpu_enable_cub_radix_sort"] is False
    engine = _engine("xla")
    treedef = jax.tree.structure(engine.params)
    small = step_function(engine.graphdef, treedef, SMALL_STEP_XLA_OPTIONS)
    assert engine.config.max_tokens_per_step <= 512
    assert engine.step_fn(True) is engine.step_fn(False) is small
    # A budget of 600: the mixed step that samples in command buffers at both its sizes (344
    # and 600), the prompt-only step op by op (one copy).
    big = _engine("xla", max_tokens_per_step=600)
    assert big.config.step_token_counts == (300 + big.config.max_seqs, 600)
    for n in big.config.step_token_counts:
        assert big.step_fn(False, num_tokens=n) is small
    large = step_function(big.graphdef, treedef, LARGE_STEP_XLA_OPTIONS, prompt_only=True, copy=0)
    assert big.step_fn(False, in_flight=True) is large and len(big._prompt_fns) == 1
    # A function of a step kind takes the kind's keywords; one that cannot is refused.
    config = dataclasses.replace(BASE, max_tokens_per_step=600)
    with pytest.raises(TypeError, match=r"xla_options: .*\(num_tokens, \*, decode, prompt_only\)"):
        Engine(_model(jnp.float32), config, xla_options=lambda num_tokens, decode: ())
    kinds = []
    Engine(_model(jnp.float32), config, xla_options=lambda n, **kind: kinds.append((n, kind)) or ())
    assert (600, dict(decode=False, prompt_only=True)) in kinds
    assert (600, dict(decode=False, prompt_only=False)) in kinds
