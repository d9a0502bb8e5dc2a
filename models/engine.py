"""The engine: jitted steps over donated KV pages and page pool, and the host loop of
continuous batching around them.

Four jitted functions, each compiled once (all shapes come from `EngineConfig`; the block once
per sampling case it meets: greedy, sampled, sampled with top-k / top-p filters; the mixed
step once per size):
  mixed   a step of T tokens, the smallest of `step_token_counts` that holds its chunks (a
          step of prompt chunks that samples nothing: the budget): prefill chunks of several
          sequences, decodes riding along; attention by `ragged_paged_attention`.
  decode  a step of one token per sequence slot; attention by `paged_decode_attention`, or,
          where sequences share their first pages, by `shared_prefix_decode_attention`.
  block   up to `decode_steps` decode steps in one `lax.while_loop`: the block reserves its
          steps' pages in the pool once, each step appends K/V, samples on the device and
          feeds the token back; rows stop on the device at a stop token or their token
          budget, and give back the pages they did not fill after the loop. Its steps' metadata
          is written out for one token per row (`_decode_metadata`), not built by the ragged
          path, and it samples in the case its rows need, without a conditional.
  fork    after the step that completes the prompt of a request of n samples: its other
          samples start as forks of it in the pool, sharing its full pages, with the copy of
          its last page in every layer (`fork_samples`).
Between them the host applies the scheduler's pool updates, each one jitted call: slots
released, and with prefix caching pages cached (`jaxpaged.retain`), evicted (`drop`) and
attached to admitted requests (`attach`). A step's host sync reads its sampled tokens. A
block's sync reads its [N, S] tokens once, and while block i runs the host has already
enqueued block i+1 from block i's device outputs, so the GPU does not wait for the host
between blocks (a server's loop that polls, `step(wait=False)`, has it enqueued shortly before
block i is due to end, so that a request that arrives meanwhile waits for one block, not
two). A step that samples nothing (prompt chunks short of their prompts' ends) is read only
after the next step is enqueued (where steps run in command buffers, in two copies that take
turns: a command buffer's launch waits for its own launch in flight); each step checks on the
device that the pool holds the cached tokens the host counted, so a step enqueued after one
that failed writes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpaged
from models import parallel
from models.config import EngineConfig
from models.decoder import Decoder, KVPages, init_kv_pages
from models.sampling import SamplingArrays, is_stop, sample, sampling_case
from models.scheduler import Plan, SamplingParams, Scheduler, Sequence

# XLA rewrites a dot whose left operand is one row (M=1) into a multiply and a reduction: three
# passes over the weight matrix instead of one (shared/GPU.md, the B=1 decode profile). Decode
# steps and blocks therefore run at least two sequence slots; the second is padding at B=1.
MIN_DECODE_ROWS = 2
# ... unless a decode step of one row runs the model's layer path
# (`Decoder.runs_layer_kernel`): its projections are kernels then, and the one dot left to XLA,
# the logits, is above the size XLA rewrites (10M elements). One slot gives the decode kernel
# the splits of one sequence and the layer kernel no padding row (benchmarks/NOTES.md,
# session 47).
LAYER_PATH_MIN_DECODE_ROWS = 1


class StepInputs(NamedTuple):
    """A step's host-built arrays. Row s < num_seqs of the batch is pool slot `seq_ids[s]`.
    Sample row r draws from the logits after the last token of row `sample_rows[r]` with the
    sampling parameters of row r: rows below num_seqs from their own, the rows after them
    (`Plan.forks`) from the row whose chunk completes their request's prompt."""

    tokens: jax.Array  # i32[T]
    seq_ids: jax.Array  # i32[S], -1 for padding rows
    cu_q_lens: jax.Array  # i32[S+1]
    num_seqs: jax.Array  # i32[]
    sample_rows: jax.Array  # i32[S]
    sampling: SamplingArrays
    # i32[S]: the tokens the host counts as cached for each row before the step. A step whose
    # rows the pool disagrees with (a step enqueued after one that failed) runs no sequence.
    num_cached: jax.Array


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree of arrays of 4-byte or bool types packed into one i32 array, so that it
    crosses between host and device in one copy: a step's host inputs (`pack` on numpy
    arrays, `unpack` inside the jitted step) and what the host reads of a step or block
    (`pack` inside the jitted function, `to_host` after it). On the H200's host each array
    that crosses costs its own transfer: a jitted call took 671 us with 11 numpy inputs and
    274 with one, and a read of 4 small outputs 0.76 ms past the GPU's work against 0.41 for
    one (benchmarks/NOTES.md runs 226 and 231). The layout (tree structure, shapes, dtypes)
    is the pytree's static part, so it keys a jitted function's cache."""

    def __init__(self, data, layout):
        self.data, self.layout = data, layout

    @classmethod
    def pack(cls, tree) -> Packed:
        """Pack `tree`'s leaves: numpy arrays on the host, traced arrays inside a jit."""
        leaves, treedef = jax.tree.flatten(tree)
        on_host = all(isinstance(x, (np.ndarray, np.generic)) for x in leaves)
        xp = np if on_host else jnp
        dtypes = [np.dtype(x.dtype) for x in leaves]
        if any(d != np.bool_ and d.itemsize != 4 for d in dtypes):
            raise TypeError(f"Packed takes 4-byte and bool dtypes; got {dtypes}")
        parts = []
        for x, dtype in zip(leaves, dtypes, strict=True):
            x = xp.reshape(x, -1)
            if dtype == np.bool_:
                parts.append(x.astype(np.int32))
            elif on_host:
                parts.append(x.view(np.int32))
            else:
                parts.append(jax.lax.bitcast_convert_type(x, jnp.int32))
        shapes = tuple((tuple(np.shape(x)), d.name) for x, d in zip(leaves, dtypes, strict=True))
        layout = (treedef, shapes)
        return cls(xp.concatenate(parts), layout)

    def unpack(self):
        """The packed tree, inside a jit."""
        return self._unpacked(self.data, jnp)

    def to_host(self):
        """The packed tree as numpy arrays: one read of `data`."""
        return self._unpacked(np.asarray(self.data), np)

    def _unpacked(self, data, xp):
        treedef, shapes = self.layout
        leaves, offset = [], 0
        for shape, dtype in shapes:
            size = int(np.prod(shape, dtype=int))
            flat = data[offset : offset + size]
            if dtype == "bool":
                flat = flat != 0
            elif xp is np:
                flat = flat.view(dtype)
            else:
                flat = jax.lax.bitcast_convert_type(flat, jnp.dtype(dtype))
            leaves.append(flat.reshape(shape))
            offset += size
        return jax.tree.unflatten(treedef, leaves)

    def tree_flatten(self):
        return (self.data,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)


class PrefixSharing(NamedTuple):
    """How decode steps and blocks group the sequences that share their first pages (static):
    the `max_group_size` and `min_saved_tokens` of `jaxpaged.find_prefix_groups`, and the
    `max_groups` of `jaxpaged.plan_cascade`."""

    max_group_size: int
    min_saved_tokens: int
    max_groups: int | None = None


class StepOutputs(NamedTuple):
    """A step's results; `tokens`, `logprobs` and `logits` are None in a step of the
    prompt-only kind, which samples nothing."""

    tokens: jax.Array | None  # i32[S], each sample row's token
    logprobs: jax.Array | None  # f32[S], their log-probabilities (temperature 1)
    ok: jax.Array  # bool[], False: the pool could not hold the step and nothing was written
    # f32[T, vocab] with all_logits, else f32[S, vocab] (rows' last tokens)
    logits: jax.Array | None
    shared_prefix: jax.Array  # bool[], the step read shared prefixes once per group
    page_table: jax.Array  # i32[max_seqs, pages_per_seq], the pool's after the step
    # (tokens, logprobs, ok, shared_prefix) again, packed: the host's one read. The page
    # table is read apart, by the prefix cache only: it grows with the engine's slots and
    # pages (2 MB at 256 slots of 2048 pages), and an engine without the cache never needs it.
    read: Packed

    @classmethod
    def of(cls, tokens, logprobs, ok, logits, shared_prefix, page_table) -> StepOutputs:
        read = Packed.pack((tokens, logprobs, ok, shared_prefix))
        return cls(tokens, logprobs, ok, logits, shared_prefix, page_table, read)


class BlockInputs(NamedTuple):
    """A decode block's rows: row s is pool slot `seq_ids[s]` (-1: padding), whose last token
    `tokens[s]` is not cached yet and who may generate `budgets[s]` more tokens (0: inactive)."""

    tokens: jax.Array  # i32[S]
    seq_ids: jax.Array  # i32[S]
    budgets: jax.Array  # i32[S]
    sampling: SamplingArrays


class BlockOutputs(NamedTuple):
    """Row s generated `tokens[:counts[s], s]`. `next` is the inputs of a following block (the
    rows' last tokens and remaining budgets), so that one can be enqueued without a sync."""

    tokens: jax.Array  # i32[N, S], -1 past each row's count
    logprobs: jax.Array  # f32[N, S]
    counts: jax.Array  # i32[S]
    steps: jax.Array  # i32[], decode steps the block ran
    ok: jax.Array  # bool[], False: it stopped before a step whose pages the pool could not hold
    shared_prefix_steps: jax.Array  # i32[], of them, the steps that read shared prefixes once
    next: BlockInputs
    # (tokens, logprobs, counts, steps, ok, shared_prefix_steps) again, packed: the host's
    # one read
    read: Packed


def _forward(
    graphdef,
    params,
    kv_pages,
    pool,
    tokens,
    seq_ids,
    cu_q_lens,
    num_seqs,
    num_cached=None,
    **static,
):
    """Reserve the step's pages, run the decoder, return the step's metadata and final hidden
    states: (kv_pages, pool, ok, meta, hidden [T, hidden], model). With `num_cached` (the
    host's count per row), a row whose pool slot holds another count makes the step run no
    sequence (`ok` False). With `shared_prefix` (a `PrefixSharing`), a decode step's metadata
    carries the groups of sequences that share their first pages, found in the pool's page
    table after the reservation. With `prompt_only`, the step holds no decode tokens
    (`StepMetadata.prompt_only`)."""
    decode, implementation = static["decode"], static["implementation"]
    shared_prefix = static["shared_prefix"]
    prompt_only = static.get("prompt_only", False)
    live = jnp.arange(seq_ids.shape[0]) < num_seqs
    seq_ids = jnp.where(live, seq_ids, -1)
    cached, _ = jaxpaged.batch_metadata(pool, seq_ids)
    agrees = jnp.bool_(True)
    if num_cached is not None:
        agrees = jnp.all(~live | (cached == num_cached))
        seq_ids = jnp.where(agrees, seq_ids, -1)
    pool, ok = jaxpaged.reserve(pool, seq_ids, cached + jnp.diff(cu_q_lens))
    ok = ok & agrees
    kv_lens, page_indices = jaxpaged.batch_metadata(pool, seq_ids)
    # A failed reservation left the pool as it was, so these lengths miss the new tokens and
    # writing them would overwrite the sequences' last cached tokens: run with no sequences.
    num_seqs = jnp.where(ok, num_seqs, 0)
    meta = jaxpaged.StepMetadata.build(
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        num_tokens=tokens.shape[0],
        decode=decode,
        pool_shape=kv_pages[0][0].shape[:2],
        prompt_only=prompt_only,
    )
    kv_pages, meta, hidden, model = _run_model(
        graphdef,
        params,
        kv_pages,
        tokens,
        meta,
        page_size=pool.page_size,
        implementation=implementation,
        shared_prefix=shared_prefix,
    )
    return kv_pages, pool, ok, meta, hidden, model


def _fewest_decode_rows(
    model: Decoder, config: EngineConfig, implementation: str | None, mesh
) -> int:
    """`MIN_DECODE_ROWS`, or `LAYER_PATH_MIN_DECODE_ROWS` where a decode step of that many
    rows runs the model's layer path (not under tensor parallelism)."""
    rows = LAYER_PATH_MIN_DECODE_ROWS
    if mesh is not None or rows >= MIN_DECODE_ROWS:
        return MIN_DECODE_ROWS
    page = jax.ShapeDtypeStruct(
        (config.num_pages, config.page_size, model.config.num_kv_heads, model.config.head_dim),
        model.config.dtype,
    )
    table = jnp.zeros((rows, config.pages_per_seq), jnp.int32)
    cached = jnp.zeros(rows, jnp.int32)
    meta = _decode_metadata(cached, table, cached == 0, jnp.int32(0), config.page_size)
    pages = [(page, page)] * model.config.num_layers
    return rows if model.runs_layer_kernel(rows, pages, meta, implementation) else MIN_DECODE_ROWS


def _decode_metadata(
    cached: jax.Array,
    table: jax.Array,
    active: jax.Array,
    step: jax.Array,
    page_size: int,
    *,
    mask_pages: bool = True,
) -> jaxpaged.StepMetadata:
    """The metadata of a block's decode step `step`, written out for its one token per row:
    row s, when `active`, appends the token at position `cached[s] + step` to its pages
    `table[s]` (reserved before the loop), else it is padding (kv_len 0, slot -1, position 0,
    and with `mask_pages` no pages: the prefix-group search reads the page table; attention
    reads no page of a row of length 0). Equal to `StepMetadata.build` over these rows,
    without its ragged path (the token search, the sanitizing, their reductions), which cost
    every step 5-8 small kernels more (benchmarks/NOTES.md, session 23)."""
    num_rows = cached.shape[0]
    pos = cached + step
    page = jnp.take_along_axis(table, (pos // page_size)[:, None], axis=1, mode="clip")[:, 0]
    return jaxpaged.StepMetadata(
        kv_lens=jnp.where(active, pos + 1, 0),
        page_indices=jnp.where(active[:, None], table, -1) if mask_pages else table,
        cu_q_lens=jnp.arange(num_rows + 1, dtype=jnp.int32),
        num_seqs=jnp.int32(num_rows),
        positions=jnp.where(active, pos, 0),
        kv_slots=jnp.where(active & (page >= 0), page * page_size + pos % page_size, -1),
        decode=True,
    )


def _run_model(
    graphdef,
    params,
    kv_pages,
    tokens,
    meta: jaxpaged.StepMetadata,
    *,
    page_size: int,
    implementation: str | None,
    shared_prefix: PrefixSharing | None,
):
    """The decoder over rows whose pages are reserved already (`meta.kv_lens` count the
    step's tokens): the step's metadata, with a decode step's prefix groups under
    `shared_prefix`, and the final hidden states. Returns (kv_pages, meta, hidden
    [T, hidden], model)."""
    decode = meta.decode
    if decode and shared_prefix is not None:
        groups = jaxpaged.find_prefix_groups(
            meta.page_indices,
            meta.kv_lens,
            page_size,
            max_group_size=shared_prefix.max_group_size,
            min_saved_tokens=shared_prefix.min_saved_tokens,
        )
        # Found and planned once per step: the barrier keeps XLA from fusing the search into
        # every layer.
        plan = jaxpaged.plan_cascade(
            groups,
            meta.page_indices,
            meta.kv_lens,
            page_size,
            max_groups=shared_prefix.max_groups,
        )
        meta = dataclasses.replace(meta, prefix_groups=jax.lax.optimization_barrier(plan))
    model = nnx.merge(graphdef, params)
    hidden, kv_pages = model(tokens, kv_pages, meta, implementation=implementation)
    return kv_pages, meta, hidden, model


def _uses_shared_prefix(meta: jaxpaged.StepMetadata) -> jax.Array:
    """bool[]: the step's decode attention reads shared prefixes once per group."""
    return jnp.bool_(False) if meta.prefix_groups is None else meta.prefix_groups.use


def model_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_pages: KVPages,
    pool: jaxpaged.PagePool,
    inputs: StepInputs,
    *,
    decode: bool,
    all_logits: bool,
    implementation: str | None,
    shared_prefix: PrefixSharing | None = None,
    conditionals_in_graph: bool = True,
    prompt_only: bool = False,
) -> tuple[KVPages, jaxpaged.PagePool, StepOutputs]:
    """One step of the decoder, traced by `step_function`, which jits it with `kv_pages` and
    `pool` donated: they come back updated in place. A decode step with `shared_prefix` reads
    the first pages that sequences share once per group. `conditionals_in_graph`: the step's
    XLA options put conditionals in command buffers; without, sampling takes no `lax.cond`
    (`sample`'s `conditionals`), which the host would wait at. The step may be enqueued before
    the one before it is read: it checks `inputs.num_cached` against the pool (a row whose
    count is not the host's makes it run nothing) and returns the pool's page table after it.
    `prompt_only`: the step's chunks are prompt chunks short of their prompts' ends, so it
    samples nothing: no vocabulary projection, no sampling (their outputs None), and ragged
    attention without its launch for decode tokens. A chunked prompt's steps then take fewer
    kernels (run without command buffers, each costs the host ~12 us: benchmarks/NOTES.md,
    "Session 12")."""
    kv_pages, pool, ok, meta, hidden, model = _forward(
        graphdef,
        params,
        kv_pages,
        pool,
        inputs.tokens,
        inputs.seq_ids,
        inputs.cu_q_lens,
        inputs.num_seqs,
        inputs.num_cached,
        decode=decode,
        implementation=implementation,
        shared_prefix=shared_prefix,
        prompt_only=prompt_only,
    )
    page_table = pool.page_indices
    if prompt_only:
        return kv_pages, pool, StepOutputs.of(None, None, ok, None, jnp.bool_(False), page_table)
    num_tokens = inputs.tokens.shape[0]
    last = jnp.clip(inputs.cu_q_lens[1:] - 1, 0, num_tokens - 1)
    if all_logits:
        logits = model.logits(hidden)
        row_logits = logits[last]
    else:
        logits = row_logits = model.logits(hidden[last])
    rows = inputs.sample_rows
    tokens, logprobs = sample(
        row_logits[rows], inputs.sampling, meta.kv_lens[rows], conditionals=conditionals_in_graph
    )
    outputs = StepOutputs.of(tokens, logprobs, ok, logits, _uses_shared_prefix(meta), page_table)
    return kv_pages, pool, outputs


def block_steps(
    pool: jaxpaged.PagePool, seq_ids: jax.Array, budgets: jax.Array, num_steps: int
) -> tuple[jax.Array, jax.Array]:
    """How many steps (at most `num_steps`) a decode block can reserve at once: the most k
    for which the free pages hold every row's next `min(k, budget)` tokens and no row grows
    past its slot's capacity. Returns (k i32[], the rows' lengths after k steps i32[S]); rows
    with no budget or a negative id (padding) do not grow."""
    cached, _ = jaxpaged.batch_metadata(pool, seq_ids)
    budgets = jnp.where(seq_ids >= 0, jnp.maximum(budgets, 0), 0)
    k = jnp.arange(num_steps + 1, dtype=jnp.int32)[:, None]
    lens = cached[None, :] + jnp.minimum(k, budgets[None, :])  # [N + 1, S]
    pages = lambda n: -(-n // pool.page_size)  # noqa: E731
    need = jnp.sum(pages(lens) - pages(cached)[None, :], axis=1)
    capacity = pool.pages_per_seq * pool.page_size
    fits = (need <= jaxpaged.num_free_pages(pool)) & jnp.all(lens <= capacity, axis=1)
    # `fits` only turns False as k grows, and k = 0 always fits.
    steps = jnp.sum(fits, dtype=jnp.int32) - 1
    return steps, lens[steps]


def decode_block(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_pages: KVPages,
    pool: jaxpaged.PagePool,
    inputs: BlockInputs,
    *,
    num_steps: int,
    implementation: str | None,
    shared_prefix: PrefixSharing | None = None,
    sampling_case: int | None = None,
) -> tuple[KVPages, jaxpaged.PagePool, BlockOutputs]:
    """Up to `num_steps` decode steps in one `lax.while_loop`, traced by `block_function`.

    Before the loop the block reserves the pages of as many steps as the pool holds for every
    active row (`block_steps`), so that its steps do no work on the pool: each appends the
    K/V of the rows' last tokens, samples the next ones and feeds them back. A row stops when
    it samples one of its stop tokens or spends its budget; its slot then runs as padding
    (kv_len 0: no read, no write). The loop ends after `num_steps` steps, when no row is
    active, or at the last step reserved (`ok` False when a row could have run on). After it,
    rows that stopped early give back the pages they did not fill (`jaxpaged.truncate`), so
    that the pool holds what steps run one at a time would leave. With `shared_prefix`, each
    step finds the sequences that share their first pages anew (`model_step`).
    `sampling_case`: the rows' `models.sampling.sampling_case` (or a case above it), which
    the block then samples with in every step (None: each step picks it on the device).
    """
    num_rows = inputs.tokens.shape[0]
    seq_ids = jnp.where(inputs.budgets > 0, inputs.seq_ids, -1)
    cached, _ = jaxpaged.batch_metadata(pool, seq_ids)
    limit, new_lens = block_steps(pool, seq_ids, inputs.budgets, num_steps)
    pool, reserved = jaxpaged.reserve(pool, seq_ids, new_lens)
    limit = jnp.where(reserved, limit, 0)
    _, table = jaxpaged.batch_metadata(pool, seq_ids)
    init = (
        jnp.int32(0),
        kv_pages,
        inputs.tokens,
        inputs.budgets,
        jnp.full((num_steps, num_rows), -1, jnp.int32),
        jnp.zeros((num_steps, num_rows), jnp.float32),
        jnp.int32(0),
    )

    def cond(carry):
        step, _, _, budgets, _, _, _ = carry
        return (step < limit) & jnp.any(budgets > 0)

    def body(carry):
        step, kv_pages, tokens, budgets, out_tokens, out_logprobs, shared = carry
        # A row still active has run every step before this one.
        active = budgets > 0
        kv_pages, meta, hidden, model = _run_model(
            graphdef,
            params,
            kv_pages,
            tokens,
            # Without sharing, an inactive row's pages are never read (kv_len 0): no select.
            _decode_metadata(
                cached, table, active, step, pool.page_size, mask_pages=shared_prefix is not None
            ),
            page_size=pool.page_size,
            implementation=implementation,
            shared_prefix=shared_prefix,
        )
        new, logprobs = sample(
            model.logits(hidden), inputs.sampling, meta.kv_lens, case=sampling_case
        )
        budgets = jnp.where(
            active, jnp.where(is_stop(new, inputs.sampling.stop_ids), 0, budgets - 1), budgets
        )
        # Row `step` (< num_steps) as an in-place update: `.at[step].set` is a scatter, whose
        # bounds check costs a kernel of its own (benchmarks/NOTES.md, session 33).
        out_tokens = _set_row(out_tokens, step, jnp.where(active, new, -1))
        out_logprobs = _set_row(out_logprobs, step, jnp.where(active, logprobs, 0.0))
        tokens = jnp.where(active, new, tokens)
        shared = shared + _uses_shared_prefix(meta)
        return step + 1, kv_pages, tokens, budgets, out_tokens, out_logprobs, shared

    steps, kv_pages, tokens, budgets, out_tokens, out_logprobs, shared = jax.lax.while_loop(
        cond, body, init
    )
    counts = jnp.sum(out_tokens >= 0, axis=0, dtype=jnp.int32)
    # Rows that stopped before the last step reserved give back the pages they did not fill.
    pool, truncated = jaxpaged.truncate(pool, seq_ids, cached + counts)
    ok = truncated & ~((steps == limit) & (limit < num_steps) & jnp.any(budgets > 0))
    next_inputs = inputs._replace(tokens=tokens, budgets=budgets)
    read = Packed.pack((out_tokens, out_logprobs, counts, steps, ok, shared))
    outputs = BlockOutputs(out_tokens, out_logprobs, counts, steps, ok, shared, next_inputs, read)
    return kv_pages, pool, outputs


def _set_row(out: jax.Array, index: jax.Array, row: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(out, row[None], (index, 0))


@jax.jit
def block_inputs_after_step(
    step_tokens: jax.Array, step_ok: jax.Array, inputs: BlockInputs
) -> BlockInputs:
    """The inputs of a decode block enqueued behind a mixed step that samples, before the host
    has read it: row s starts from the step's sample `step_tokens[s]` (chunk s's), with the
    budget the host gave it (its budget less that sample). A row whose sample is one of its
    stop tokens is inactive, and so is every row where the step failed (`step_ok` False): the
    block then runs no step and changes nothing."""
    rows = min(step_tokens.shape[0], inputs.tokens.shape[0])
    tokens = inputs.tokens.at[:rows].set(step_tokens[:rows])
    stopped = is_stop(tokens, inputs.sampling.stop_ids)
    budgets = jnp.where(step_ok & ~stopped, inputs.budgets, 0)
    return inputs._replace(tokens=tokens, budgets=budgets)


@functools.partial(jax.jit, donate_argnames=("kv_pages", "pool"))
def fork_samples(
    kv_pages: KVPages, pool: jaxpaged.PagePool, src: jax.Array, dst_seq_ids: jax.Array
) -> tuple[KVPages, jaxpaged.PagePool, jax.Array]:
    """Start the empty slots `dst_seq_ids` (i32[N], -1 pads: N fixed so that this compiles once)
    as forks of the active slot `src` (i32[]): `jaxpaged.fork`, then the copies of `src`'s
    partly filled last page that it asks for, in every layer, in one call. Pages and pool are
    donated. Returns `(kv_pages, pool, ok)`; `ok` False (the pool could not hold the copies, or
    the slots break `validate_fork`'s rules) changed nothing."""
    pool, ok, copies = jaxpaged.fork(pool, src, dst_seq_ids)
    return [jaxpaged.copy_pages(k, v, *copies) for k, v in kv_pages], pool, ok


# `Engine.step(wait=False)` enqueues the next decode block this long before the block in
# flight is expected to end: enough for the host's launch of the next (the GPU idled ~1.3 ms a
# block where it came after the end, benchmarks/NOTES.md runs 216-217), and a request that
# arrives within it waits for one more block.
BLOCK_LAUNCH_LEAD_S = 2e-3

# XLA options of the engine's steps on GPUs (ignored elsewhere). A step of the ~1B decoder is
# 250-400 kernels, and launching them one by one costs the host milliseconds. XLA's command
# buffers (CUDA graphs) cut that, but the graph is updated before it is launched, so the GPU
# waits for the host instead of starting on the first kernel. Steps whose tokens the host
# reads at once (decode, and mixed steps that sample) gain at every size measured: a sampling
# mixed step beside 15 decode rows, from launch to read, 4.8 against 5.5 ms at 528 tokens, 6.5
# against 6.6 at 1040, 9.0 against 9.4 at 2048 (benchmarks/NOTES.md run 220, with a minimum
# graph size of 1: every run of compatible kernels one graph). Prompt-only steps, which stay in
# flight while the next is launched, keep command buffers up to 512 tokens only: above that
# their kernels are long enough to hide the launches of the next step's. Command buffers also
# take while loops and conditionals (CUDA graph conditional nodes), so that a decode block's
# loop runs with no host round trip per step, but only when every command inside the loop can
# be recorded: XLA sorts rows of 32k logits for top-k / top-p of 64 rows with CUB's radix
# sort, a custom call a command buffer does not take, which left the whole loop to the host
# (one predicate read and relaunch per step); its own sort kernels stay in the graph. The
# measurements behind these rules: benchmarks/NOTES.md, "End to end", "Session 8", "Session
# 10" and "Session 42". Steps above `COMMAND_BUFFER_MAX_TOKENS` (not measured in command
# buffers since the early engine of "End to end", where a 2048-token step lost) run op by op.
COMMAND_BUFFER_MAX_TOKENS = 2048
PROMPT_ONLY_COMMAND_BUFFER_MAX_TOKENS = 512
COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
SMALL_STEP_XLA_OPTIONS = (
    ("xla_gpu_graph_min_graph_size", 1),
    ("xla_gpu_enable_command_buffer", COMMAND_BUFFER_TYPES),
    ("xla_gpu_enable_cub_radix_sort", False),
)
LARGE_STEP_XLA_OPTIONS = (("xla_gpu_enable_command_buffer", ""),)
# Decode steps and blocks of at least this many rows also take XLA's exhaustive GEMM tiling
# search. In the `1b` decode block on the H200 it made the projections' GEMMs 0.5-1.3 us a call
# faster at 16 and 64 rows: B=16 14,193 -> 14,512-14,571 tokens/s (GPU 1.108 -> 1.078 ms a
# step), B=64 30,095 -> 30,646-30,843 (2.140 -> 2.103-2.112), two processes each (runs
# 192-193; run 170 likewise). At B=1 the gain is within the spread between processes (+0.9% in
# run 193, -1.5% in run 170), so one-row blocks skip the search and its compile time. The
# search costs ~40 s of compile per decode executable, paid once per engine (their rows are
# `EngineConfig.max_seqs`); XLA's `--xla_gpu_per_fusion_autotune_cache_dir` keeps the results
# between processes.
EXHAUSTIVE_TILING_MIN_ROWS = 16
EXHAUSTIVE_TILING = (("xla_gpu_exhaustive_tiling_search", True),)


def uses_command_buffers(xla_options: tuple[tuple[str, object], ...]) -> bool:
    """Whether a step compiled with `xla_options` runs in command buffers on a GPU (XLA's
    default does; `LARGE_STEP_XLA_OPTIONS` turns them off)."""
    return dict(xla_options).get("xla_gpu_enable_command_buffer", "default") != ""


def step_xla_options(
    num_tokens: int,
    *,
    decode: bool = False,
    prompt_only: bool = False,
    graphs_up_to: int | None = None,
) -> tuple[tuple[str, object], ...]:
    """The XLA options of a step or block of `num_tokens` tokens (its T); `decode`: one token
    per row (decode projections keep XLA's Triton GEMMs at every batch: with the whole block
    in one command buffer they beat cuBLAS at 16 and 64 rows, benchmarks/NOTES.md "Session
    10"; from `EXHAUSTIVE_TILING_MIN_ROWS` rows they take the exhaustive tiling search);
    `prompt_only`: a step that samples nothing. Steps of at most `graphs_up_to` tokens run in
    command buffers (None: `COMMAND_BUFFER_MAX_TOKENS`, `PROMPT_ONLY_COMMAND_BUFFER_MAX_TOKENS`
    for prompt-only steps)."""
    if graphs_up_to is None:
        graphs_up_to = (
            PROMPT_ONLY_COMMAND_BUFFER_MAX_TOKENS if prompt_only else COMMAND_BUFFER_MAX_TOKENS
        )
    if num_tokens > graphs_up_to:
        options = LARGE_STEP_XLA_OPTIONS
    else:
        options = SMALL_STEP_XLA_OPTIONS
    if decode and num_tokens >= EXHAUSTIVE_TILING_MIN_ROWS:
        options += EXHAUSTIVE_TILING
    return options


@functools.cache
def step_function(
    graphdef: nnx.GraphDef,
    params_treedef: jax.tree_util.PyTreeDef,
    xla_options: tuple[tuple[str, object], ...] = (),
    shared_prefix: PrefixSharing | None = None,
    prompt_only: bool = False,
    copy: int = 0,
):
    """`model_step` jitted once per model structure, taking the parameters as the flat list of
    their leaves and its `StepInputs` packed (`Packed`; the engine's step; `decode`,
    `all_logits` and `implementation` are static, `shared_prefix` and `prompt_only` are bound
    here). Another `copy` is another
    jitted function of the same step: an executable, and command buffers, of its own.

    Dispatch hashes a jitted function's static arguments and flattens its pytree arguments on
    every call: the GraphDef of the 1B decoder took milliseconds to hash as a static argument
    (5.4 ms per B=1 decode step on the H200 instead of 3.6), and flattening its nnx.State
    hundreds of microseconds, so both are bound here instead."""

    conditionals_in_graph = "CONDITIONAL" in str(
        dict(xla_options).get("xla_gpu_enable_command_buffer", "")
    )

    def step(param_leaves, kv_pages, pool, inputs, **static):
        params = jax.tree.unflatten(params_treedef, param_leaves)
        return model_step(
            graphdef,
            params,
            kv_pages,
            pool,
            inputs.unpack(),
            shared_prefix=shared_prefix,
            conditionals_in_graph=conditionals_in_graph or jax.default_backend() != "gpu",
            prompt_only=prompt_only,
            **static,
        )

    return jax.jit(
        step,
        static_argnames=("decode", "all_logits", "implementation"),
        donate_argnames=("kv_pages", "pool"),
        compiler_options=compiler_options(xla_options),
    )


@functools.cache
def block_function(
    graphdef: nnx.GraphDef,
    params_treedef: jax.tree_util.PyTreeDef,
    xla_options: tuple[tuple[str, object], ...] = (),
    shared_prefix: PrefixSharing | None = None,
):
    """`decode_block` jitted as `step_function` jits `model_step` (`num_steps` and
    `implementation` static, `shared_prefix` bound here, pages, pool and inputs donated: a
    chain of blocks then runs on the same buffers, which the GPU's command buffers record by
    address)."""

    def block(param_leaves, kv_pages, pool, inputs, **static):
        params = jax.tree.unflatten(params_treedef, param_leaves)
        return decode_block(
            graphdef, params, kv_pages, pool, inputs, shared_prefix=shared_prefix, **static
        )

    return jax.jit(
        block,
        static_argnames=("num_steps", "implementation", "sampling_case"),
        donate_argnames=("kv_pages", "pool", "inputs"),
        compiler_options=compiler_options(xla_options),
    )


def compiler_options(xla_options: tuple[tuple[str, object], ...]) -> dict | None:
    """`xla_options` as `jax.jit`'s `compiler_options`: they are GPU options, so None
    elsewhere."""
    return dict(xla_options) if jax.default_backend() == "gpu" else None


@dataclasses.dataclass
class Stats:
    """Throughput counters. A step that computes any prompt (or recomputed) tokens counts as
    prefill time; decode time and tokens come from decode steps and blocks. A block's time runs
    from the previous block's sync (or its own launch, when none ran before it) to its sync, so
    that with blocks enqueued ahead it is the wall time the host waited for. `forked_samples`
    counts the samples of n-sample requests that started as forks (their prompt computed once
    for the request), `failed_forks` the forks the pool could not hold (their samples then
    computed their prompts on their own). With prefix caching, admissions looked up
    `prefix_queried_pages` full prompt pages in the cache and found `prefix_hit_pages` of them
    (the pages saved: neither computed nor stored again); `prefix_evicted_pages` were
    evicted.

    `peak_pages` is the most pages of the pool in use at once (held by a slot or by the prefix
    cache, a shared page once), counted on the host from the scheduler's page accounting, so
    no step waits for it: at the end of every step (its forks included) and every decode block,
    before the slots that finished in it are released. A block enqueued ahead of the one the
    host reads also counts the pages of the rows that finished in that one, whose release waits
    for it on the device. Those are the moments the pool is at its fullest, so it equals the
    most used pages the pool's refcounts ever show, while the scheduler's counts are the pool's
    (a step, block or fork the pool refused says they were not). `shared_prefix_steps` counts
    the decode steps whose attention read the first pages that sequences share once per group
    (`EngineConfig.shared_prefix_attention`)."""

    prefill_tokens: int = 0
    prefill_time: float = 0.0
    prefill_steps: int = 0
    decode_tokens: int = 0
    decode_time: float = 0.0
    decode_steps: int = 0
    blocks: int = 0
    # Blocks that stopped before a step whose pages the pool could not hold.
    cut_blocks: int = 0
    steps: int = 0
    failed_steps: int = 0
    # Steps that sampled nothing, enqueued before the step before them was read (prompt chunks
    # short of their prompts' ends); a step's time then runs from that read to its own.
    steps_in_flight: int = 0
    # Host time inside the jitted calls (argument handling and launch; the GPU runs on after
    # they return), summed over all steps and blocks.
    dispatch_time: float = 0.0
    # Blocks enqueued behind a mixed step that samples, before the host read it.
    blocks_after_steps: int = 0
    forked_samples: int = 0
    failed_forks: int = 0
    prefix_queried_pages: int = 0
    prefix_hit_pages: int = 0
    prefix_evicted_pages: int = 0
    peak_pages: int = 0
    shared_prefix_steps: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """The share of looked-up prompt pages found in the prefix cache."""
        queried = self.prefix_queried_pages
        return self.prefix_hit_pages / queried if queried else 0.0


class _Block(NamedTuple):
    """A decode block in flight: its rows (row s is `rows[s]`, padding rows omitted) and its
    outputs (device arrays being copied to the host)."""

    rows: list[Sequence]
    out: BlockOutputs


class _Step(NamedTuple):
    """A step in flight, enqueued before the one before it was read: it samples nothing, and
    the host has counted its chunks as cached already (`slots`: each chunk's slot then)."""

    plan: Plan
    slots: list[int]
    start: float  # perf_counter() at its launch
    out: StepOutputs


class Engine:
    """Continuous batching over one decoder: owns its KV pages, page pool and scheduler.

    `overlap`: enqueue the next decode block before reading the current one's tokens (the
    default); False syncs after every block. `mesh`: a tensor-parallel mesh
    (`models.parallel.make_mesh`); the parameters and KV pages are placed split over it, the
    pool replicated, and every step runs under it (`jax.set_mesh`). `prefix_sharing` is the
    `PrefixSharing` of the decode steps and blocks (None: plain decode).
    """

    def __init__(
        self,
        model: Decoder,
        config: EngineConfig,
        *,
        implementation: str | None = None,
        xla_options: tuple[tuple[str, object], ...] | Callable | None = None,
        overlap: bool = True,
        mesh: jax.sharding.Mesh | None = None,
    ):
        """`xla_options`: XLA options of every step kind, or a function giving a kind's from
        `(num_tokens, *, decode, prompt_only)`; None: `step_xla_options`."""
        # Preemption lets the oldest sequence run alone, so one sequence must fit the pool.
        if config.pages_per_seq > config.num_pages:
            raise ValueError(
                f"the pool ({config.num_pages} pages) must hold one sequence of "
                f"max_model_len={config.max_model_len} tokens"
            )
        self.config = config
        self.implementation = implementation
        self.overlap = overlap
        self.decode_rows = max(
            _fewest_decode_rows(model, config, implementation, mesh), config.max_seqs
        )
        self.mesh = mesh
        self.graphdef, self.params = nnx.split(model)
        if mesh is not None:
            parallel.check_divisible(model.config, mesh)
            self.params = parallel.shard_params(self.params, mesh)
        self.param_leaves, treedef = jax.tree.flatten(self.params)

        # A mesh of another platform's devices (host devices on a GPU machine) takes none of
        # this backend's options.
        foreign = mesh is not None and mesh.devices.flat[0].platform != jax.default_backend()

        if callable(xla_options):
            try:
                inspect.signature(xla_options).bind(0, decode=False, prompt_only=False)
            except TypeError as e:
                raise TypeError(
                    "xla_options: a function of a step kind must take "
                    "(num_tokens, *, decode, prompt_only), as step_xla_options does"
                ) from e

        def options(num_tokens, decode=False, prompt_only=False):
            if foreign:
                return ()
            if xla_options is not None and not callable(xla_options):
                return tuple(xla_options)
            kind_options = step_xla_options if xla_options is None else xla_options
            return tuple(kind_options(num_tokens, decode=decode, prompt_only=prompt_only))

        decode_options = options(self.decode_rows, decode=True)
        mixed_sizes = {n: options(n) for n in config.step_token_counts}
        prompt_options = options(config.max_tokens_per_step, prompt_only=True)
        # Whether a step of a kind may stay in flight while the next is enqueued: not where it
        # runs in a command buffer, whose next launch waited for it on the H200 and took
        # longer than the read it saved (benchmarks/NOTES.md, "Session 11"). Every step kind
        # checks the host's counts (`model_step`), so any step may be enqueued behind one in
        # flight.
        on_gpu = jax.default_backend() == "gpu" and not foreign
        self._may_stay = {
            kind: not (on_gpu and uses_command_buffers(opts))
            for kind, opts in ((True, decode_options), (False, prompt_options))
        }
        self.prefix_sharing = self._prefix_sharing(model)
        # Decode steps and blocks come in two kinds: plain, and with the shared-prefix path
        # (when `prefix_sharing` is set); each call takes the plain one unless the scheduler
        # says that running sequences share pages, so a batch without sharing pays nothing for
        # the path (its lax.cond per layer and the group search per step). Without sharing, no
        # argument: the cached function of a call that does not name it.
        plain_decode = step_function(self.graphdef, treedef, decode_options)
        plain_block = block_function(self.graphdef, treedef, decode_options)
        self._decode_fns = {False: plain_decode, True: plain_decode}
        self._block_fns = {False: plain_block, True: plain_block}
        if self.prefix_sharing is not None:
            sharing = self.prefix_sharing
            self._decode_fns[True] = step_function(self.graphdef, treedef, decode_options, sharing)
            self._block_fns[True] = block_function(self.graphdef, treedef, decode_options, sharing)
        # Mixed steps of prompt chunks that sample nothing may stay in flight (below), in a
        # kind of their own: prompt-only (no vocabulary projection, sampling or decode-token
        # attention). Where they run in command buffers, the prompt-only kind keeps them in
        # two copies that take turns, so that a launch never finds its own command
        # buffer in flight: a prompt in chunks of 512 then keeps the GPU busy while the host
        # plans and launches the next chunk, one graph launch instead of ~200 kernels
        # (benchmarks/NOTES.md, "Session 22").
        # The mixed kind at each of its sizes (`EngineConfig.step_token_counts`): a plan runs
        # in the smallest that holds it. Prompt-only steps fill the budget with their chunks,
        # and keep it.
        self._mixed_fns = {
            n: step_function(self.graphdef, treedef, opts) for n, opts in mixed_sizes.items()
        }
        self._prompt_fns = tuple(
            step_function(self.graphdef, treedef, prompt_options, prompt_only=True, copy=i)
            for i in range(1 if self._may_stay[False] else 2)
        )
        self._prompt_steps = 0  # prompt-only steps launched, for their turns
        self.vocab_size = model.config.vocab_size
        self.kv_pages = init_kv_pages(model.config, config.num_pages, config.page_size)
        self.pool = jaxpaged.create_pool(
            config.num_pages, config.page_size, config.max_seqs, config.pages_per_seq
        )
        if mesh is not None:
            pages = NamedSharding(mesh, parallel.KV_PAGES_SPEC)
            self.kv_pages = jax.device_put(self.kv_pages, pages)
            self.pool = jax.device_put(self.pool, NamedSharding(mesh, P()))
        self.scheduler = Scheduler(config)
        self.stats = Stats()
        self._next_id = 0
        self._block: _Block | None = None  # the decode block in flight
        self._step: _Step | None = None  # the step in flight
        self._last_read = 0.0  # perf_counter() when the host last read a step
        self._last_block_failed = False
        # perf_counter() at the last block's read, or the first block's launch: about when the
        # block in flight began on the GPU.
        self._clock = 0.0
        self._block_step_s = None  # seconds a step of the last full block took
        self._pool_oks: list[jax.Array] = []  # of the prefix cache's pool updates, unread
        # Pages whose release the host enqueued after the decode block in flight: held till it
        # ends.
        self._released_after_block = 0
        # Where steps run in command buffers, the pool updates the host schedules between
        # steps compile now rather than mid-generation: XLA's compile of any executable
        # evicts every other's command buffers (CUDA graphs), and an executable run after an
        # eviction runs once op by op before it records its graph again. The first `release`,
        # when the first sequences finished, cost the decode block after it ~20 ms of host
        # time at 16 rows with the GPU idle (benchmarks/NOTES.md, runs 207-208).
        kinds_options = (decode_options, prompt_options, *mixed_sizes.values())
        if on_gpu and any(map(uses_command_buffers, kinds_options)):
            self._compile_pool_updates()
        # The mixed kind compiles at each of its sizes now too: a plan meets a size when its
        # tokens come to it, and a compile mid-generation stalls the host for seconds.
        if on_gpu:
            self._compile_mixed_steps()

    def _compile_pool_updates(self) -> None:
        """Compile the pool updates the host schedules between steps, by running each once on
        padding ids only, which changes nothing: `release`, `fork_samples`, and with the
        prefix cache `retain`, `drop` and `attach`, at the shapes the engine calls them with.
        The constructor calls this where steps run in command buffers."""
        config = self.config
        no_seqs = np.full(config.max_seqs, -1, np.int32)
        with self._calling():
            self.pool = jaxpaged.release(self.pool, no_seqs)
            # An inactive source: `ok` is False and nothing is forked or copied.
            self.kv_pages, self.pool, _ = fork_samples(
                self.kv_pages, self.pool, np.int32(-1), no_seqs
            )
        if self.scheduler.cache is not None:
            no_rows = np.full((config.max_seqs, config.pages_per_seq), -1, np.int32)
            self._pool_update(jaxpaged.retain, self._page_ids([]))
            self._pool_update(jaxpaged.drop, self._page_ids([]))
            self._pool_update(jaxpaged.attach, no_seqs, no_rows, np.zeros_like(no_seqs))
            self._check_pool_updates()

    def _compile_mixed_steps(self) -> None:
        """Compile the mixed kind at each of its sizes by running it on a plan of no chunks,
        which changes nothing (its tokens are padding: no slot, no page), and
        `block_inputs_after_step` on its outputs. The constructor calls this on a GPU."""
        empty = Plan([])
        for num_tokens, fn in self._mixed_fns.items():
            with self._calling():
                self.kv_pages, self.pool, out = fn(
                    self.param_leaves,
                    self.kv_pages,
                    self.pool,
                    self._inputs(empty, decode=False, num_tokens=num_tokens),
                    decode=False,
                    all_logits=False,
                    implementation=self.implementation,
                )
            out.ok.block_until_ready()
        if self.config.decode_steps is not None:  # and the inputs of a block behind one
            with self._calling():
                block_inputs_after_step(out.tokens, out.ok, self._block_inputs([]))

    def _prefix_sharing(self, model: Decoder) -> PrefixSharing | None:
        """The decode steps' `PrefixSharing`. None (plain decode, and no shared-prefix path
        compiled) when it is off, under a sliding window (each query sees its own keys), when
        the backends take no group of two for the model, or when no step can save
        `shared_prefix_min_tokens`: a step saves at most `(max_seqs - 1) * (pages_per_seq -
        1) * page_size` tokens (all slots in one group, sharing all pages but the last)."""
        config, model_config = self.config, model.config
        size = config.max_prefix_group or jaxpaged.default_max_group_size(
            model_config.num_q_heads, model_config.num_kv_heads
        )
        most_saved = (config.max_seqs - 1) * (config.pages_per_seq - 1) * config.page_size
        if (
            not config.shared_prefix_attention
            or model_config.sliding_window is not None
            or size < 2
            or most_saved < config.shared_prefix_min_tokens
        ):
            return None
        return PrefixSharing(size, config.shared_prefix_min_tokens, config.max_prefix_groups)

    def step_fn(
        self,
        decode: bool,
        shared_prefix: bool = True,
        in_flight: bool = False,
        turn: int = 0,
        num_tokens: int | None = None,
    ):
        """The jitted step of one kind: `step_fn(decode)(param_leaves, kv_pages, pool, inputs,
        *, decode, all_logits, implementation) -> (kv_pages, pool, StepOutputs)`, inputs as
        `_inputs` packs them, pages and pool donated. A decode step has the shared-prefix path
        when `prefix_sharing` is set, unless `shared_prefix` is False; `in_flight`: the
        prompt-only step that may stay in flight, the copy whose `turn` it is (of two where
        mixed steps run in command buffers); else the mixed step of `num_tokens` tokens (one
        of `config.step_token_counts`; None: the budget)."""
        if decode:
            return self._decode_fns[shared_prefix]
        if in_flight:
            return self._prompt_fns[turn % len(self._prompt_fns)]
        return self._mixed_fns[num_tokens or self.config.max_tokens_per_step]

    @property
    def block_fn(self):
        """The jitted decode block: `block_fn(param_leaves, kv_pages, pool, inputs, *,
        num_steps, implementation) -> (kv_pages, pool, BlockOutputs)`, pages, pool and inputs
        donated; with the shared-prefix path when `prefix_sharing` is set (`plain_block_fn`:
        without)."""
        return self._block_fns[True]

    @property
    def plain_block_fn(self):
        """The decode block without the shared-prefix path."""
        return self._block_fns[False]

    def _shares_pages(self) -> bool:
        """Whether the next decode step or block should take the shared-prefix path: set, and
        running sequences may share pages (`Scheduler.may_share_pages`)."""
        return self.prefix_sharing is not None and self.scheduler.may_share_pages()

    @contextlib.contextmanager
    def _calling(self):
        """The context of a jitted call: the mesh, and no Triton deprecation warning."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(jaxpaged.quiet_triton_deprecation())
            if self.mesh is not None:
                stack.enter_context(jax.set_mesh(self.mesh))
            yield

    def add_request(self, prompt: Seq[int], params: SamplingParams) -> Sequence:
        """Queue a request; it is admitted when a slot per sample, pages and the step's budget
        allow. Returns sample 0, whose `samples` are all n (`SamplingParams.n`)."""
        total = len(prompt) + params.max_new_tokens
        if not prompt or total > self.config.max_model_len:
            raise ValueError(
                f"need a non-empty prompt and prompt + max_new_tokens <= max_model_len="
                f"{self.config.max_model_len}; got {len(prompt)} + {params.max_new_tokens}"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, vocab_size={self.vocab_size})")
        stops = params.stop_token_ids
        if len(stops) > self.config.max_stop_tokens or any(t >= self.vocab_size for t in stops):
            raise ValueError(
                f"stop_token_ids must hold at most max_stop_tokens="
                f"{self.config.max_stop_tokens} ids below vocab_size={self.vocab_size}; "
                f"got {stops}"
            )
        n, page_size = params.n, self.config.page_size
        # The step that completes the prompt holds its pages and a copy of its last page per
        # other sample, however small the pool: it may have to run alone.
        fork_pages = -(-len(prompt) // page_size) + (n - 1) * (len(prompt) % page_size != 0)
        if n > self.config.max_seqs or (n > 1 and fork_pages > self.config.num_pages):
            raise ValueError(
                f"SamplingParams.n={n} needs a slot per sample (max_seqs="
                f"{self.config.max_seqs}) and {fork_pages} pages for the {len(prompt)}-token "
                f"prompt and the copies of its last page (num_pages={self.config.num_pages})"
            )
        samples = [
            Sequence(
                self._next_id + i,
                [int(t) for t in prompt],
                len(prompt),
                params.for_sample(i),
                sample_index=i,
            )
            for i in range(n)
        ]
        for seq in samples:
            seq.samples = samples
        self._next_id += n
        self.scheduler.add(samples[0])
        return samples[0]

    def has_work(self) -> bool:
        return self._block is not None or self._step is not None or self.scheduler.has_work()

    def step(self, *, record_prompt_logits: bool = False, wait: bool = True) -> list[Sequence]:
        """Run one step, or enqueue or finish a decode block; returns the sequences it finished.

        Decode-only plans run as blocks of up to `config.decode_steps` steps, unless
        `decode_steps` is None or `record_prompt_logits` asks for every step's logits. A
        mixed step that samples, after which every running sequence decodes and no request
        can start, has the first block enqueued behind it before the host reads it
        (`_block_may_follow`); the call that reads the step returns with that block in flight.

        `wait=False` is for a server's loop that adds requests as they arrive: while the
        decode block in flight runs and a slot may come free by its end, the call returns []
        at once, having enqueued and read nothing, until the block is within
        `BLOCK_LAUNCH_LEAD_S` of its end (by the last full block's time per step). Then it
        does what `wait` does: it enqueues the next block and waits for this one. A request
        added before then waits for the rest of one block, not for a block enqueued behind
        it too. Enqueued at the block's end instead, the next block left the GPU idle ~1.3
        ms (benchmarks/NOTES.md runs 216-217). Where no slot can come free (all taken, and
        no row's token budget ends within the block) the call waits at once: a request added
        meanwhile could not start sooner. A row that stops at a stop token frees its slot
        unforeseen: a request may then wait for one more block.
        """
        if self._block is not None:
            if not wait and self._slot_may_free() and not self._block_ending():
                return []
            return self._next_block()
        plan = self.scheduler.schedule()
        self.stats.prefix_queried_pages += plan.prefix_queried
        self.stats.prefix_hit_pages += plan.prefix_hits
        self._release_pending()
        self._evict_and_attach()
        if not plan.chunks:
            self._read_in_flight()  # a step in flight samples nothing: it finishes nobody
            return []
        blocks = self.config.decode_steps is not None and not record_prompt_logits
        as_block = blocks and all(c.is_decode for c in plan.chunks)
        # Where decode-only plans run as blocks, a plan of one-token chunks that is not a
        # block (a one-token prompt, or a prompt's last token, beside decode rows) runs in the
        # mixed kind: the decode step kind would compile for that plan alone, mid-generation
        # (26 s at 16 rows on the H200, benchmarks/NOTES.md runs 211-213).
        decode = plan.decode and not blocks
        # A step that samples nothing (prompt chunks short of their prompts' ends) may stay in
        # flight: no read before the next is planned. Every step kind checks the host's
        # counts (`model_step`), so the next step, one that samples too, is enqueued behind
        # it and the step in flight is read after; only a block reads it first. A step after
        # a failed one runs nothing and its plan is dropped: it changed nothing the next plan
        # does not redo (its admissions are running sequences at their start, their pages
        # attached).
        stays = (
            self.overlap
            and not record_prompt_logits
            and not any(c.samples for c in plan.chunks)
            and (self._may_stay[decode] or not decode)
        )
        if as_block and not self._read_in_flight():
            return []
        if as_block:
            self._clock = time.perf_counter()
            rows = [c.seq for c in plan.chunks]
            self._block = _Block(rows, self._launch_block(self._block_inputs(rows), rows))
            return [] if self.overlap else self._next_block()
        num_tokens = self._num_tokens(plan, decode, stays)
        inputs = self._inputs(plan, decode, num_tokens)
        start = time.perf_counter()
        with self._calling():
            fn = self.step_fn(
                decode,
                shared_prefix=self._shares_pages(),
                in_flight=stays,
                turn=self._prompt_steps,
                num_tokens=num_tokens,
            )
            self._prompt_steps += stays
            self.kv_pages, self.pool, out = fn(
                self.param_leaves,
                self.kv_pages,
                self.pool,
                inputs,
                decode=decode,
                all_logits=record_prompt_logits and not decode,
                implementation=self.implementation,
            )
        self.stats.dispatch_time += time.perf_counter() - start
        if not stays and not record_prompt_logits and self._block_may_follow(plan):
            self._launch_block_after(plan, out)
        # A step in flight has its chunks counted as cached; the step before it is read now,
        # while it runs.
        previous, self._step = self._step, None
        if stays:
            for c in plan.chunks:
                c.seq.num_cached += c.length
            self._step = _Step(plan, [c.seq.slot for c in plan.chunks], start, out)
            self.stats.steps_in_flight += 1
            out.read.data.copy_to_host_async()
            if self.scheduler.cache is not None:
                out.page_table.copy_to_host_async()
        failed_before = previous is not None and not self._read_step(previous)
        if failed_before and self._step is not None:
            # It failed, and so did the step just enqueued if it holds one of its sequences.
            self._read_in_flight(after_failure=True)
            return []
        if self._step is not None:
            return []
        tokens, logprobs, ok, shared = out.read.to_host()
        self._check_pool_updates()
        now = time.perf_counter()
        elapsed, self._last_read = now - max(start, self._last_read), now
        if self._block is not None:
            self._clock = now  # the block behind the step begins about now
        self.stats.steps += 1
        if not ok:
            self._drop_block_after_failure()
            self.stats.failed_steps += 1
            if not failed_before:  # else that failure preempted already
                self.scheduler.on_failed_step()
            return []
        if record_prompt_logits:
            self._record_logits(plan, np.asarray(out.logits))
        self._count(plan, elapsed)
        self.stats.shared_prefix_steps += int(shared)
        page_table = None
        if self.scheduler.cache is not None and any(
            c.start < c.seq.prompt_len for c in plan.chunks
        ):
            page_table = np.asarray(out.page_table)  # the pages the prompts filled
        finished = self.scheduler.update(plan, tokens, logprobs, page_table)
        self._count_peak()
        self._retain_pending()
        self._fork_pending()
        # A block enqueued behind the step runs before these releases (of rows that sampled a
        # stop token, inactive in it).
        if self._block is not None:
            self._released_after_block = self.scheduler.releasing_pages
        self._release_pending()
        return finished

    def _block_may_follow(self, plan: Plan) -> bool:
        """Whether a decode block may be enqueued behind the mixed step of `plan` that samples,
        before the host reads it, so that the GPU does not idle through the host's read, plan
        and launch between them: blocks are on, and after the step every running sequence
        decodes (each has a chunk that samples, and no sample is forked from it), no request
        can start (every slot taken, and no row's budget ends with the step: only a stop token
        frees a slot, as in a block enqueued behind a block), and the pool holds a block's
        growth of every row beside what the step leaves."""
        config, scheduler = self.config, self.scheduler
        if not self.overlap or config.decode_steps is None or plan.forks or scheduler.free_slots:
            return False
        chunks = plan.chunks
        if len(chunks) != len(scheduler.running) or not all(c.samples for c in chunks):
            return False
        if any(c.seq.tokens_left <= 1 for c in chunks):
            return False
        return scheduler.holds_growth(plan, config.decode_steps)

    def _launch_block_after(self, plan: Plan, out: StepOutputs) -> None:
        """Enqueue a decode block behind the mixed step of `plan` (`_block_may_follow`), its
        rows' tokens the step's samples on the device (`block_inputs_after_step`)."""
        rows = [c.seq for c in plan.chunks]
        inputs = self._block_inputs(rows)
        inputs.budgets[: len(rows)] -= 1  # the step's sample
        with self._calling():
            inputs = block_inputs_after_step(out.tokens, out.ok, inputs)
        self._block = _Block(rows, self._launch_block(inputs, rows))
        self.stats.blocks_after_steps += 1

    def _drop_block_after_failure(self) -> None:
        """Drop the block enqueued behind a step that failed: its rows were inactive
        (`block_inputs_after_step`), so it ran no step and changed nothing."""
        block, self._block = self._block, None
        if block is not None and jax.device_get(block.out.steps) != 0:
            raise RuntimeError("a decode block behind a failed step ran")

    def sync(self) -> list[Sequence]:
        """Finish the decode block or step in flight, if any, enqueueing none after it; returns
        the sequences it finished. The host's view (scheduler, pool) is then up to date."""
        self._read_in_flight()
        if self._block is None:
            return []
        block, self._block = self._block, None
        return self._finish_block(block)

    def _read_in_flight(self, *, after_failure: bool = False) -> bool:
        """Read the step in flight, if any (`_read_step`); False if it failed."""
        step, self._step = self._step, None
        return step is None or self._read_step(step, after_failure=after_failure)

    def _read_step(self, step: _Step, *, after_failure: bool = False) -> bool:
        """Read a step that was left in flight: count it and cache the prompt pages it filled;
        if it failed, take back the cached tokens the host had counted for its chunks and,
        unless it follows a failed step (which it failed with), preempt as after a failed
        step. A chunk whose sequence has left its slot since (preempted) is skipped. Returns
        the step's ok."""
        _, _, ok, _ = step.out.read.to_host()
        self._check_pool_updates()
        now = time.perf_counter()
        elapsed, self._last_read = now - max(step.start, self._last_read), now
        self.stats.steps += 1
        chunks = [
            c for c, slot in zip(step.plan.chunks, step.slots, strict=True) if c.seq.slot == slot
        ]
        if not ok:
            self.stats.failed_steps += 1
            for c in chunks:
                c.seq.num_cached = min(c.seq.num_cached, c.start)
            if not after_failure:
                self.scheduler.on_failed_step()
            return False
        self._count(step.plan, elapsed)
        if self.scheduler.cache is not None:
            self.scheduler.cache_prompt_pages(chunks, np.asarray(step.out.page_table))
        self._count_peak()
        self._retain_pending()
        return True

    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        *,
        record_prompt_logits: bool = False,
    ) -> list[Sequence]:
        """Run every prompt to completion; returns their sequences in the prompts' order (of
        n-sample requests sample 0, whose `samples` holds all n)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.has_work():
            self.step(record_prompt_logits=record_prompt_logits)
        return seqs

    def _block_ending(self) -> bool:
        """Whether the decode block in flight has run (its outputs are on the device), or is
        expected to end within `BLOCK_LAUNCH_LEAD_S`: it has run since the host read the
        block before it (or launched it), for as long as a full block took last, less the
        lead."""
        if self._block.out.steps.is_ready():
            return True
        if self._block_step_s is None:
            return False
        expected = self._block_step_s * self.config.decode_steps
        return time.perf_counter() - self._clock >= expected - BLOCK_LAUNCH_LEAD_S

    def _slot_may_free(self) -> bool:
        """Whether a request could start after the decode block in flight: a slot is free,
        or a row's token budget ends within the block (the host has read the blocks before
        it)."""
        steps = self.config.decode_steps
        return bool(self.scheduler.free_slots) or any(
            s.finished or s.tokens_left <= steps for s in self._block.rows
        )

    def _next_block(self) -> list[Sequence]:
        """Enqueue the block after the one in flight when it may do work, then finish the one
        in flight."""
        block, self._block = self._block, None
        num_steps = self.config.decode_steps
        may_run = any(not s.finished and s.tokens_left > num_steps for s in block.rows)
        # A waiting request that a slot could take is admitted after this block, in a mixed step.
        admits = self.scheduler.waiting and self.scheduler.free_slots
        if self.overlap and may_run and not admits and not self._last_block_failed:
            self._block = _Block(block.rows, self._launch_block(block.out.next, block.rows))
        return self._finish_block(block)

    def _launch_block(self, inputs: BlockInputs, rows: Seq[Sequence]) -> BlockOutputs:
        """Enqueue a block over `rows` (`inputs` built from them, or a block's `next`). Its
        sampling case comes from the rows' parameters: a greedy batch compiles and runs a
        block without the sampler's conditional (one compile per case the engine meets)."""
        start = time.perf_counter()
        params = [s.params for s in rows]
        case = sampling_case(
            [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params]
        )
        with self._calling():
            self.kv_pages, self.pool, out = self._block_fns[self._shares_pages()](
                self.param_leaves,
                self.kv_pages,
                self.pool,
                inputs,
                num_steps=self.config.decode_steps,
                implementation=self.implementation,
                sampling_case=case,
            )
        self.stats.dispatch_time += time.perf_counter() - start
        out.read.data.copy_to_host_async()
        return out

    def _finish_block(self, block: _Block) -> list[Sequence]:
        out = block.out
        tokens, logprobs, counts, steps, ok, shared = out.read.to_host()
        self._check_pool_updates()
        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        if steps == self.config.decode_steps:
            self._block_step_s = elapsed / steps
        self.stats.blocks += 1
        self.stats.steps += int(steps)
        self.stats.decode_steps += int(steps)
        self.stats.decode_tokens += int(counts.sum())
        self.stats.decode_time += elapsed
        self.stats.shared_prefix_steps += int(shared)
        self._last_block_failed = not ok
        self.stats.cut_blocks += not ok
        if not ok and steps == 0:
            # Nothing ran: the pool could not hold one more token of every row (the scheduler's
            # plan said it could, so its accounting was off). A block enqueued after this one
            # retries on the same pool, or a better one (pages released in between); with none
            # in flight, preempt as after a failed step. Preempting a row of a block in flight
            # would let it write the K/V of a sequence the host has reset.
            self.stats.failed_steps += 1
            if self._block is None:
                self.scheduler.on_failed_step()
        finished = self.scheduler.update_block(block.rows, tokens, logprobs, counts)
        self._count_peak()
        # A block in flight was enqueued before this release, which thus runs after it.
        in_flight = self._block is not None
        self._released_after_block = self.scheduler.releasing_pages if in_flight else 0
        self._release_pending()
        return finished

    def _sampling(self, seqs: Seq[Sequence], num_rows: int) -> SamplingArrays:
        temperatures = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        stop_ids = np.full((num_rows, self.config.max_stop_tokens), -1, np.int32)
        for i, seq in enumerate(seqs):
            p = seq.params
            temperatures[i], top_k[i], top_p[i], seeds[i] = p.temperature, p.top_k, p.top_p, p.seed
            stop_ids[i, : len(p.stop_token_ids)] = p.stop_token_ids
        return SamplingArrays(temperatures, top_k, top_p, seeds, stop_ids)

    def _block_inputs(self, rows: list[Sequence]) -> BlockInputs:
        num_rows = self.decode_rows
        tokens = np.zeros(num_rows, np.int32)
        seq_ids = np.full(num_rows, -1, np.int32)
        budgets = np.zeros(num_rows, np.int32)
        for i, seq in enumerate(rows):
            tokens[i], seq_ids[i] = seq.tokens[-1], seq.slot
            budgets[i] = seq.tokens_left
        return BlockInputs(tokens, seq_ids, budgets, self._sampling(rows, num_rows))

    def _num_tokens(self, plan: Plan, decode: bool, prompt_only: bool) -> int:
        """The token count (T) of the step that runs `plan`: a decode step's rows, the budget
        of a prompt-only step, the smallest of `config.step_token_counts` that holds a mixed
        step's chunks."""
        if decode:
            return self.decode_rows
        if prompt_only:
            return self.config.max_tokens_per_step
        tokens = sum(c.length for c in plan.chunks)
        return next(n for n in self.config.step_token_counts if n >= tokens)

    def _inputs(self, plan: Plan, decode: bool, num_tokens: int | None = None) -> Packed:
        """The inputs of a step of `plan` in the decode kind (`decode`) or the mixed one, of
        `num_tokens` tokens (None: the decode rows, or the budget): its `StepInputs`, packed."""
        num_seq_slots = self.decode_rows if decode else self.config.max_seqs
        if num_tokens is None:
            num_tokens = num_seq_slots if decode else self.config.max_tokens_per_step
        tokens = np.zeros(num_tokens, np.int32)
        seq_ids = np.full(num_seq_slots, -1, np.int32)
        cu_q_lens = np.zeros(num_seq_slots + 1, np.int32)
        num_cached = np.zeros(num_seq_slots, np.int32)
        offset = 0
        for i, c in enumerate(plan.chunks):
            tokens[offset : offset + c.length] = c.seq.tokens[c.start : c.start + c.length]
            offset += c.length
            seq_ids[i], num_cached[i] = c.seq.slot, c.start
            cu_q_lens[i + 1] = offset
        cu_q_lens[len(plan.chunks) + 1 :] = offset
        # The forked samples fit after the chunks: each holds a slot of its own.
        sample_rows = np.arange(num_seq_slots, dtype=np.int32)
        sample_rows[len(plan.chunks) : len(plan.chunks) + len(plan.forks)] = [
            row for row, _ in plan.forks
        ]
        seqs = [c.seq for c in plan.chunks] + [forked for _, forked in plan.forks]
        sampling = self._sampling(seqs, num_seq_slots)
        return Packed.pack(
            StepInputs(
                tokens,
                seq_ids,
                cu_q_lens,
                np.int32(len(plan.chunks)),
                sample_rows,
                sampling,
                num_cached,
            )
        )

    def _fork_pending(self) -> None:
        """Run the forks the scheduler queued (the samples that start after this step); the
        samples of a fork the pool could not hold wait to be computed on their own."""
        forks, self.scheduler.to_fork = self.scheduler.to_fork, []
        oks = []
        for src, samples in forks:
            # Padded to max_seqs ids so that `fork_samples` compiles once.
            dst = np.full(self.config.max_seqs, -1, np.int32)
            dst[: len(samples)] = [s.slot for s in samples]
            with self._calling():
                self.kv_pages, self.pool, ok = fork_samples(
                    self.kv_pages, self.pool, np.int32(src), dst
                )
            oks.append(ok)
        for (_, samples), ok in zip(forks, jax.device_get(oks), strict=True):
            if ok:
                self.stats.forked_samples += len(samples)
            else:
                self.stats.failed_forks += 1
                self.scheduler.on_failed_fork(samples)

    def _pool_update(self, fn, *args) -> None:
        """Run a pool update of the prefix cache (pool donated); its `ok` is read at the next
        sync, by `_check_pool_updates`."""
        with self._calling():
            self.pool, ok = fn(self.pool, *args)
        self._pool_oks.append(ok)

    def _check_pool_updates(self) -> None:
        oks, self._pool_oks = jax.device_get(self._pool_oks), []
        if not all(oks):
            raise RuntimeError(
                "a prefix cache update was refused by the page pool: the scheduler's view of "
                "the cached pages disagrees with the pool's"
            )

    def _page_ids(self, pages: list[int]) -> np.ndarray:
        # Padded to num_pages ids so that `retain` and `drop` compile once.
        ids = np.full(self.config.num_pages, -1, np.int32)
        ids[: len(pages)] = pages
        return ids

    def _evict_and_attach(self) -> None:
        """Drop the pages the scheduler evicted from the prefix cache, then start the admitted
        requests on their cached pages."""
        scheduler = self.scheduler
        if scheduler.to_evict:
            self.stats.prefix_evicted_pages += len(scheduler.to_evict)
            self._pool_update(jaxpaged.drop, self._page_ids(scheduler.to_evict))
            scheduler.to_evict.clear()
        if scheduler.to_attach:
            # Padded to max_seqs rows so that `attach` compiles once.
            seq_ids = np.full(self.config.max_seqs, -1, np.int32)
            rows = np.full((self.config.max_seqs, self.config.pages_per_seq), -1, np.int32)
            kv_lens = np.zeros(self.config.max_seqs, np.int32)
            for i, (slot, pages) in enumerate(scheduler.to_attach):
                seq_ids[i], rows[i, : len(pages)] = slot, pages
                kv_lens[i] = len(pages) * self.config.page_size
            self._pool_update(jaxpaged.attach, seq_ids, rows, kv_lens)
            scheduler.to_attach.clear()

    def _retain_pending(self) -> None:
        """Hold the pages the scheduler put in the prefix cache, before any slot is released."""
        if self.scheduler.to_retain:
            self._pool_update(jaxpaged.retain, self._page_ids(self.scheduler.to_retain))
            self.scheduler.to_retain.clear()

    def _release_pending(self) -> None:
        # Padded to max_seqs ids so that `release` compiles once.
        if not self.scheduler.to_release:
            return
        ids = np.full(self.config.max_seqs, -1, np.int32)
        slots = np.unique(self.scheduler.to_release)
        ids[: len(slots)] = slots
        self.pool = jaxpaged.release(self.pool, ids)
        self.scheduler.to_release.clear()
        self.scheduler.releasing_pages = 0

    def _count_peak(self) -> None:
        """Count the pages in use at the end of the step or block just read (`Stats.peak_pages`),
        before the releases that follow it."""
        scheduler = self.scheduler
        used = scheduler.num_held_pages() + scheduler.releasing_pages + self._released_after_block
        self.stats.peak_pages = max(self.stats.peak_pages, used)

    def _record_logits(self, plan: Plan, logits: np.ndarray) -> None:
        offset = 0
        for i, c in enumerate(plan.chunks):
            seq = c.seq
            if seq.prompt_logits is None:
                seq.prompt_logits = np.full((seq.prompt_len, self.vocab_size), np.nan, np.float32)
            # A decode step's logits are per row; a mixed step's per token.
            rows = logits[i : i + 1] if plan.decode else logits[offset : offset + c.length]
            end = min(c.start + c.length, seq.prompt_len)
            if c.start < end:
                seq.prompt_logits[c.start : end] = rows[: end - c.start]
            if c.samples:
                seq.output_logits.append(rows[-1])
            offset += c.length
        for row, forked in plan.forks:
            parent = plan.chunks[row].seq
            forked.prompt_logits = parent.prompt_logits.copy()
            forked.output_logits.append(parent.output_logits[-1])

    def _count(self, plan: Plan, elapsed: float) -> None:
        if all(c.is_decode for c in plan.chunks):
            self.stats.decode_tokens += len(plan.chunks)
            self.stats.decode_time += elapsed
            self.stats.decode_steps += 1
        else:
            self.stats.prefill_tokens += sum(c.length for c in plan.chunks if not c.is_decode)
            self.stats.prefill_time += elapsed
            self.stats.prefill_steps += 1
