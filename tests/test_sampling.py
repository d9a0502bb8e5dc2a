"""On-device sampling: the top-k / top-p filters against a NumPy statement of the rule, and
samples that stay inside what the filters keep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sampling import (
    DRAW,
    FILTERED_DRAW,
    GREEDY,
    SamplingArrays,
    filter_logits,
    is_stop,
    max_argmax_sum_exp,
    sample,
    sampling_case,
)

VOCAB = 64


def _kept_reference(logits: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """The tokens a row keeps: its k most likely (all when k is 0), then the most likely of
    those until their renormalized probability reaches top_p."""
    order = np.argsort(-logits, kind="stable")
    if top_k:
        order = order[:top_k]
    if top_p >= 1:
        return set(order.tolist())
    probs = np.exp(logits[order] - logits[order].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    return set(order[before < top_p].tolist())


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.95), (10, 0.7), (3, 0.1)]
)
def test_filter_keeps_the_top_k_then_the_nucleus(top_k, top_p):
    logits = jax.random.normal(jax.random.key(top_k), (6, VOCAB)) * 3.0
    rows = logits.shape[0]
    out = np.asarray(
        filter_logits(logits, jnp.full(rows, top_k, jnp.int32), jnp.full(rows, top_p, jnp.float32))
    )
    for row, kept in zip(np.asarray(logits), out, strict=True):
        assert set(np.flatnonzero(np.isfinite(kept)).tolist()) == _kept_reference(row, top_k, top_p)
        np.testing.assert_array_equal(kept[np.isfinite(kept)], row[np.isfinite(kept)])


def test_rows_filter_independently():
    logits = jax.random.normal(jax.random.key(0), (3, VOCAB))
    out = filter_logits(logits, jnp.array([0, 2, 0]), jnp.array([1.0, 1.0, 0.3]))
    np.testing.assert_array_equal(out[0], logits[0])
    assert int(jnp.sum(jnp.isfinite(out[1]))) == 2


def _arrays(rows, temperature, top_k=0, top_p=1.0, stop=(-1,)):
    return SamplingArrays(
        jnp.full(rows, temperature, jnp.float32),
        jnp.full(rows, top_k, jnp.int32),
        jnp.full(rows, top_p, jnp.float32),
        jnp.arange(rows, dtype=jnp.uint32),
        jnp.tile(jnp.asarray(stop, jnp.int32), (rows, 1)),
    )


def test_samples_stay_in_the_filtered_set_and_follow_the_seed():
    rows = 256
    logits = jnp.tile(jax.random.normal(jax.random.key(1), (1, VOCAB)), (rows, 1))
    positions = jnp.full(rows, 7, jnp.int32)
    tokens, logprobs = sample(logits, _arrays(rows, 1.0, top_k=4), positions)
    top4 = set(np.argsort(-np.asarray(logits[0]))[:4].tolist())
    assert set(np.asarray(tokens).tolist()) == top4  # 256 seeds reach each of the four
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(logits[0])[tokens], rtol=0, atol=1e-6)
    again, _ = sample(logits, _arrays(rows, 1.0, top_k=4), positions)
    np.testing.assert_array_equal(again, tokens)
    moved, _ = sample(logits, _arrays(rows, 1.0, top_k=4), positions + 1)
    assert not np.array_equal(moved, tokens)


@pytest.mark.parametrize("conditionals", [True, False])
def test_temperature_sharpens_and_flattens(conditionals):
    """256 seeds over one row's logits: at temperature 1e-3 every sample is the argmax, at
    100 the samples spread over most of the vocabulary (at 1 neither holds)."""
    rows = 256
    logits = jnp.tile(jax.random.normal(jax.random.key(4), (1, VOCAB)) * 2.0, (rows, 1))
    positions = jnp.full(rows, 3, jnp.int32)

    def tokens(temperature):
        params = _arrays(rows, temperature)
        return np.asarray(sample(logits, params, positions, conditionals=conditionals)[0])

    assert (tokens(1e-3) == int(jnp.argmax(logits[0]))).all()
    assert len(set(tokens(100.0).tolist())) > VOCAB // 2
    at_one = tokens(1.0)
    assert 1 < len(set(at_one.tolist())) <= VOCAB // 2


def test_greedy_rows_take_the_argmax_whatever_the_filters():
    logits = jax.random.normal(jax.random.key(2), (4, VOCAB))
    tokens, _ = sample(logits, _arrays(4, 0.0, top_k=3, top_p=0.2), jnp.zeros(4, jnp.int32))
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))


def test_one_reduction_gives_the_argmax_and_log_softmax():
    """`max_argmax_sum_exp` against `jnp.argmax` and `jax.nn.log_softmax` on random rows of a
    real vocabulary's size, and on the rows where a reduction can go wrong: ties (the first
    index wins), NaN (the first NaN is the argmax, its log-probability NaN), -inf everywhere
    (index 0, as `jnp.argmax`) and one finite logit among -inf (log-probability 0)."""
    vocab = 4096
    logits = jax.random.normal(jax.random.key(7), (8, vocab)) * 4.0
    top, index, sum_exp = jax.jit(max_argmax_sum_exp)(logits)
    np.testing.assert_array_equal(index, jnp.argmax(logits, axis=-1))
    np.testing.assert_array_equal(top, jnp.max(logits, axis=-1))
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(index)[:, None], 1)
    # The sum's float32 rounding, at most (vocab - 1) ulps of it in any order of summation.
    tol = vocab * np.finfo(np.float32).eps
    np.testing.assert_allclose(-np.log(sum_exp), want[:, 0], rtol=0, atol=tol)

    inf, nan = np.inf, np.nan
    special = jnp.array(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],
            [nan, 1.0, nan, 2.0, 0.0],
            [2.0, 5.0, nan, 1.0, 5.0],
            [-inf] * 5,
            [-inf, -inf, 1.5, -inf, -inf],
        ]
    )
    top, index, sum_exp = jax.jit(max_argmax_sum_exp)(special)
    np.testing.assert_array_equal(index, jnp.argmax(special, axis=-1))
    np.testing.assert_array_equal(index, [1, 0, 2, 0, 2])
    logprob = np.asarray(-jnp.log(sum_exp))
    assert np.isnan(logprob[[1, 2]]).all() and np.isnan(np.asarray(top)[[1, 2]]).all()
    np.testing.assert_allclose(logprob[0], np.log(1 / (3 + np.exp(-2) + np.exp(-3))), rtol=1e-6)
    assert logprob[4] == 0.0 and np.isfinite(np.asarray(sum_exp)[3])


def test_is_stop_ignores_padding_ids():
    stop_ids = jnp.array([[5, -1], [-1, -1], [0, 9]])
    np.testing.assert_array_equal(is_stop(jnp.array([5, 5, 9]), stop_ids), [True, False, True])


@pytest.mark.parametrize("temperature,filtered", [(0.8, False), (0.8, True), (0.0, True)])
def test_sampling_without_its_conditionals_gives_the_same_tokens(temperature, filtered):
    """`conditionals=False` (steps whose XLA runs conditionals on the host) traces no `cond`
    and samples what the conditional way samples: for rows that filter and rows that do not,
    and for a greedy batch, whose conditional skips the random draw. Half the rows of the
    sampled batches are greedy."""
    rows = 8
    logits = jax.random.normal(jax.random.key(3), (rows, VOCAB)) * 2.0
    params = _arrays(rows, temperature, top_k=5 if filtered else 0, top_p=0.9 if filtered else 1.0)
    params = params._replace(temperatures=params.temperatures.at[::2].set(0.0))
    positions = jnp.arange(rows, dtype=jnp.int32) + 11
    plain = jax.jit(lambda x: sample(x, params, positions, conditionals=False))
    assert "cond" not in str(jax.make_jaxpr(plain)(logits))
    assert "cond" in str(jax.make_jaxpr(lambda x: sample(x, params, positions))(logits))
    got, want = plain(logits), sample(logits, params, positions)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    greedy = params.temperatures == 0
    np.testing.assert_array_equal(got[0][greedy], jnp.argmax(logits, axis=-1)[greedy])
    if temperature > 0:  # the draw ran: some sampled row leaves its argmax
        assert (got[0][~greedy] != jnp.argmax(logits, axis=-1)[~greedy]).any()


@pytest.mark.parametrize("temperature,filtered", [(0.8, False), (0.8, True), (0.0, True)])
def test_a_static_case_samples_what_the_conditional_samples(temperature, filtered):
    """`case` (a block whose rows' parameters the host knows) traces no `cond` and gives the
    conditional's tokens and log-probabilities, at the rows' `sampling_case` and every case
    above it; a bad case is refused."""
    rows = 8
    logits = jax.random.normal(jax.random.key(5), (rows, VOCAB)) * 2.0
    params = _arrays(rows, temperature, top_k=5 if filtered else 0, top_p=0.9 if filtered else 1.0)
    params = params._replace(temperatures=params.temperatures.at[::2].set(0.0))
    positions = jnp.arange(rows, dtype=jnp.int32) + 7
    case = sampling_case(*jax.device_get((params.temperatures, params.top_k, params.top_p)))
    assert case == (GREEDY if temperature == 0 else FILTERED_DRAW if filtered else DRAW)
    want = sample(logits, params, positions)
    for c in range(case, FILTERED_DRAW + 1):
        fn = jax.jit(lambda x, c=c: sample(x, params, positions, case=c))
        assert "cond" not in str(jax.make_jaxpr(fn)(logits))
        for g, w in zip(fn(logits), want, strict=True):
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="case must be"):
        sample(logits, params, positions, case=3)


def test_sampling_case_is_the_largest_any_row_needs():
    assert sampling_case([0.0, 0.0], [5, 0], [0.5, 1.0]) == GREEDY  # greedy rows never filter
    assert sampling_case([0.0, 0.7], [0, 0], [1.0, 1.0]) == DRAW
    assert sampling_case([0.7, 0.0], [0, 3], [1.0, 1.0]) == DRAW
    assert sampling_case([0.7, 0.7], [0, 3], [1.0, 1.0]) == FILTERED_DRAW
    assert sampling_case([0.7], [0], [0.9]) == FILTERED_DRAW
    assert sampling_case([], [], []) == GREEDY
