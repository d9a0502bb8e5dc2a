"""Sampling on the device: greedy, temperature, top-k and top-p, one key per (seed, position).

A row's sample depends only on its own logits, its parameters and the position of the token it
samples: `fold_in(key(seed), position)` picks the noise, and the filters work row by row. So a
request samples the same tokens whatever shares its batch, however many decode steps a block
runs, and after a preemption.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters of a step or block (S rows; padding rows are greedy).

    temperatures: f32[S], 0 for greedy.
    top_k: i32[S], keep the k most likely tokens; 0 keeps all.
    top_p: f32[S] in (0, 1], keep the smallest set of most likely tokens whose probability
      (after top-k) reaches top_p; 1 keeps all.
    seeds: u32[S].
    stop_ids: i32[S, max_stop_tokens], tokens that end the row once sampled; -1 pads.
    """

    temperatures: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    stop_ids: jax.Array


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set every logit outside each row's top-k, then top-p, set to -inf.

    logits: f32[S, V] (already divided by the temperature); top_k: i32[S]; top_p: f32[S].
    Ties with the last kept logit are kept, so a row may keep a few more than k tokens. Rows
    with top_k 0 and top_p 1 come back unchanged.
    """
    vocab = logits.shape[-1]
    ranked = -jnp.sort(-logits, axis=-1)  # [S, V], descending
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    ranked = jnp.where(rank < k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    # A token is kept when the tokens ranked above it hold less than top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (rank < k) & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(ranked, (num_kept - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


GREEDY, DRAW, FILTERED_DRAW = 0, 1, 2  # `sample`'s cases


def _filters(temperatures, top_k, top_p):
    """bool[S]: the rows that sample through the top-k / top-p filters (NumPy or JAX)."""
    return (temperatures > 0) & ((top_k > 0) | (top_p < 1.0))


def sampling_case(temperatures, top_k, top_p) -> int:
    """The `sample` case that rows with these parameters (host arrays) need: GREEDY when no
    row samples, DRAW when none filters, else FILTERED_DRAW. A case covers the ones below it."""
    temperatures, top_k, top_p = (np.asarray(a) for a in (temperatures, top_k, top_p))
    return int((temperatures > 0).any()) + int(_filters(temperatures, top_k, top_p).any())


def sample(
    logits: jax.Array,
    params: SamplingArrays,
    positions: jax.Array,
    *,
    conditionals: bool = True,
    case: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One token per row: argmax where the temperature is 0, else a categorical sample of the
    filtered, temperature-scaled logits.

    logits: f32[S, V]; positions: i32[S], the position of the token being sampled. Returns
    (tokens i32[S], logprobs f32[S]): the log-probabilities are those of the unfiltered model at
    temperature 1. `conditionals`: one `lax.switch` skips the filters' sort when no row
    filters (tens of microseconds a step), and the scaling by temperature and the random draw
    too when no row samples (a greedy batch); False computes all of them always. Where XLA
    runs a conditional on the host (outside command buffers), the host reads its predicate,
    so the call that launches the step waits there for the GPU to reach it: such steps take
    False. `case` (`sampling_case` of the rows, known when tracing) takes that branch without
    a conditional: no predicate to compute and no conditional to run in every step.
    """
    temperatures = params.temperatures
    # Which branch runs depends on the batch but no row's sample does: rows with top_k 0 and
    # top_p 1 come back from the filters unchanged, and rows at temperature 0 take the argmax.
    filters = _filters(temperatures, params.top_k, params.top_p)

    def draw(x, *, filtered=False):
        x = x / jnp.where(temperatures > 0, temperatures, 1.0)[:, None]
        if filtered:
            x = filter_logits(x, params.top_k, params.top_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
            params.seeds, positions
        )
        return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)

    def greedy(x):
        return jnp.zeros(x.shape[:1], jnp.int32)

    branches = (greedy, draw, functools.partial(draw, filtered=True))
    if case is not None:
        if case not in (GREEDY, DRAW, FILTERED_DRAW):
            raise ValueError(f"case must be GREEDY, DRAW or FILTERED_DRAW (0-2); got {case!r}")
        sampled = branches[case](logits)
    elif conditionals:  # a greedy batch (0), sampling without filters (1) or with them (2)
        index = jnp.any(temperatures > 0).astype(jnp.int32) + jnp.any(filters).astype(jnp.int32)
        sampled = jax.lax.switch(index, branches, logits)
    else:
        sampled = draw(logits, filtered=True)
    top, argmax, sum_exp = max_argmax_sum_exp(logits)
    if case == GREEDY:  # the argmax's own logit is the max: log_softmax there is -log(sum)
        return argmax, -jnp.log(sum_exp)
    tokens = jnp.where(temperatures > 0, sampled, argmax)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, (chosen - top) - jnp.log(sum_exp)


def max_argmax_sum_exp(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pass over f32[S, V]: each row's max m, its argmax (the first index of the max, a NaN
    counting as the max, as `jnp.argmax`) and sum(exp(x - m)), so that log_softmax(x) is
    `(x - m) - log(sum)`. One variadic reduction whose partial sums are rescaled to the running
    max: XLA runs it in the kernels of one reduction, where `jnp.argmax` and
    `jax.nn.log_softmax` took two each (benchmarks/NOTES.md, session 33)."""

    def combine(a, b):
        (ma, ia, sa), (mb, ib, sb) = a, b
        a_nan, b_nan = ma != ma, mb != mb
        a_above = (ma > mb) | (a_nan & ~b_nan)
        tie = (ma == mb) | (a_nan & b_nan)
        m = jnp.where(a_above, ma, mb)
        index = jnp.where(a_above | (tie & (ia < ib)), ia, ib)
        # A side at the max keeps its sum as it is (so -inf maxima give no NaN).
        scaled = lambda s, x: jnp.where(x == m, s, s * jnp.exp(x - m))  # noqa: E731
        return m, index, scaled(sa, ma) + scaled(sb, mb)

    logits = logits.astype(jnp.float32)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jax.lax.reduce(
        (logits, index, jnp.ones_like(logits)),
        (np.float32(-np.inf), np.int32(0), np.float32(0)),
        combine,
        (logits.ndim - 1,),
    )


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """bool[S]: row s sampled one of its stop tokens (tokens i32[S], stop_ids i32[S, n]).

    Written out as n compares rather than `any` over a [S, n] product: a reduction is a kernel
    of its own in a decode block, the compares fuse into the selects that read them."""
    columns = [tokens == stop_ids[:, j] for j in range(stop_ids.shape[-1])]
    return functools.reduce(jnp.logical_or, columns, jnp.zeros(tokens.shape, bool))
