"""The engine: jitted step functions over donated KV pages and page pool, and the host loop of
continuous batching around them.

A step is one jitted call: reserve the pages of its tokens, run the decoder on a flat ragged
batch, sample one token per sequence. Two kinds, each compiled once (all shapes come from
`EngineConfig`):
  mixed   T = max_tokens_per_step tokens: prefill chunks of several sequences, decodes riding
          along; attention by `ragged_paged_attention`.
  decode  T = S = max_seqs, one token per sequence; attention by `paged_decode_attention`.
The host reads the sampled tokens and the reservation's `ok` once per step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence as Seq
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpaged
from models.config import EngineConfig
from models.decoder import Decoder, KVPages, init_kv_pages
from models.scheduler import Plan, SamplingParams, Scheduler, Sequence


class StepInputs(NamedTuple):
    """A step's host-built arrays. Row s < num_seqs of the batch is pool slot `seq_ids[s]`."""

    tokens: jax.Array  # i32[T]
    seq_ids: jax.Array  # i32[S], -1 for padding rows
    cu_q_lens: jax.Array  # i32[S+1]
    num_seqs: jax.Array  # i32[]
    temperatures: jax.Array  # f32[S]
    seeds: jax.Array  # u32[S]


class StepOutputs(NamedTuple):
    tokens: jax.Array  # i32[S], each row's sample after its last token
    logprobs: jax.Array  # f32[S], their log-probabilities (temperature 1)
    ok: jax.Array  # bool[], False: the pool could not hold the step and nothing was written
    logits: jax.Array  # f32[T, vocab] with all_logits, else f32[S, vocab] (rows' last tokens)


def sample(logits: jax.Array, temperatures: jax.Array, seeds: jax.Array, positions: jax.Array):
    """Greedy where temperature is 0, else a categorical sample at that temperature.

    logits f32[S, V]; temperatures f32[S]; seeds u32[S]; positions i32[S], the position of the
    token being sampled. The key is `fold_in(key(seed), position)`: a request samples the same
    tokens whatever else is batched with it, and after a preemption. Returns (i32[S], f32[S]).
    """
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    scaled = logits / jnp.where(temperatures > 0, temperatures, 1.0)[:, None]
    sampled = jax.vmap(jax.random.categorical)(keys, scaled)
    tokens = jnp.where(temperatures > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


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
) -> tuple[KVPages, jaxpaged.PagePool, StepOutputs]:
    """One step of the decoder, traced by `step_function`, which jits it with `kv_pages` and
    `pool` donated: they come back updated in place."""
    num_tokens = inputs.tokens.shape[0]
    num_seq_slots = inputs.seq_ids.shape[0]
    live = jnp.arange(num_seq_slots) < inputs.num_seqs
    cached, _ = jaxpaged.batch_metadata(pool, inputs.seq_ids)
    # Padding rows ask slot 0 for length 0: `reserve` treats that as a no-op, a -1 as an error.
    pool, ok = jaxpaged.reserve(
        pool,
        jnp.where(live, inputs.seq_ids, 0),
        jnp.where(live, cached + jnp.diff(inputs.cu_q_lens), 0),
    )
    kv_lens, page_indices = jaxpaged.batch_metadata(pool, inputs.seq_ids)
    # A failed reservation left the pool as it was, so these lengths miss the new tokens and
    # writing them would overwrite the sequences' last cached tokens: run with no sequences.
    num_seqs = jnp.where(ok, inputs.num_seqs, 0)
    meta = jaxpaged.StepMetadata.build(
        kv_lens, page_indices, inputs.cu_q_lens, num_seqs, num_tokens=num_tokens, decode=decode
    )
    model = nnx.merge(graphdef, params)
    hidden, kv_pages = model(inputs.tokens, kv_pages, meta, implementation=implementation)
    last = jnp.clip(inputs.cu_q_lens[1:] - 1, 0, num_tokens - 1)
    if all_logits:
        logits = model.logits(hidden)
        row_logits = logits[last]
    else:
        logits = row_logits = model.logits(hidden[last])
    tokens, logprobs = sample(row_logits, inputs.temperatures, inputs.seeds, kv_lens)
    return kv_pages, pool, StepOutputs(tokens, logprobs, ok, logits)


# XLA options of the engine's steps on GPUs (ignored elsewhere). A step of the ~1B decoder is
# 300-400 kernels, and launching them one by one costs the host milliseconds. XLA's command
# buffers (CUDA graphs) cut that, but the graph is updated before it is launched, so the GPU
# waits for the host instead of starting on the first kernel. Small steps, whose kernels take
# less time than their launches, gain: with a minimum graph size of 1 (every run of compatible
# kernels one graph), a 256-token step of the 1B decoder took 3.83 ms against 4.53 ms without
# command buffers, decode B=64 3.28 ms against 4.26 (same H200 run, benchmarks/NOTES.md run
# 11). Large steps lose: a 2048-token step took 15.3 ms with them against 10.2 without (runs
# 12 and 10).
COMMAND_BUFFER_MAX_TOKENS = 512
SMALL_STEP_XLA_OPTIONS = (("xla_gpu_graph_min_graph_size", 1),)
LARGE_STEP_XLA_OPTIONS = (("xla_gpu_enable_command_buffer", ""),)


def step_xla_options(num_tokens: int) -> tuple[tuple[str, object], ...]:
    """The XLA options of a step of `num_tokens` tokens (its T)."""
    if num_tokens <= COMMAND_BUFFER_MAX_TOKENS:
        return SMALL_STEP_XLA_OPTIONS
    return LARGE_STEP_XLA_OPTIONS


@functools.cache
def step_function(
    graphdef: nnx.GraphDef,
    params_treedef: jax.tree_util.PyTreeDef,
    xla_options: tuple[tuple[str, object], ...] = (),
):
    """`model_step` jitted once per model structure, taking the parameters as the flat list of
    their leaves (the engine's step; `decode`, `all_logits` and `implementation` are static).

    Dispatch hashes a jitted function's static arguments and flattens its pytree arguments on
    every call: the GraphDef of the 1B decoder took milliseconds to hash as a static argument
    (5.4 ms per B=1 decode step on the H200 instead of 3.6), and flattening its nnx.State
    hundreds of microseconds, so both are bound here instead."""

    def step(param_leaves, kv_pages, pool, inputs, **static):
        params = jax.tree.unflatten(params_treedef, param_leaves)
        return model_step(graphdef, params, kv_pages, pool, inputs, **static)

    return jax.jit(
        step,
        static_argnames=("decode", "all_logits", "implementation"),
        donate_argnames=("kv_pages", "pool"),
        compiler_options=compiler_options(xla_options),
    )


def compiler_options(xla_options: tuple[tuple[str, object], ...]) -> dict | None:
    """`xla_options` as `jax.jit`'s `compiler_options`: they are GPU options, so None
    elsewhere."""
    return dict(xla_options) if jax.default_backend() == "gpu" else None


@dataclasses.dataclass
class Stats:
    """Throughput counters. A step that computes any prompt (or recomputed) tokens counts as
    prefill time; decode time and tokens come from steps that only decode."""

    prefill_tokens: int = 0
    prefill_time: float = 0.0
    prefill_steps: int = 0
    decode_tokens: int = 0
    decode_time: float = 0.0
    decode_steps: int = 0
    steps: int = 0
    failed_steps: int = 0
    # Host time inside the jitted call (argument handling and launch; the GPU runs on after
    # it returns), summed over all steps: what overlapping steps could hide at most.
    dispatch_time: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0


class Engine:
    """Continuous batching over one decoder: owns its KV pages, page pool and scheduler."""

    def __init__(
        self,
        model: Decoder,
        config: EngineConfig,
        *,
        implementation: str | None = None,
        xla_options: tuple[tuple[str, object], ...] | None = None,
    ):
        """`xla_options`: XLA options of both step kinds; None: `step_xla_options` of each
        kind's token count."""
        # Preemption lets the oldest sequence run alone, so one sequence must fit the pool.
        if config.pages_per_seq > config.num_pages:
            raise ValueError(
                f"the pool ({config.num_pages} pages) must hold one sequence of "
                f"max_model_len={config.max_model_len} tokens"
            )
        self.config = config
        self.implementation = implementation
        self.graphdef, self.params = nnx.split(model)
        self.param_leaves, treedef = jax.tree.flatten(self.params)
        self._step_fns = {
            decode: step_function(
                self.graphdef,
                treedef,
                step_xla_options(num_tokens) if xla_options is None else tuple(xla_options),
            )
            for decode, num_tokens in ((True, config.max_seqs), (False, config.max_tokens_per_step))
        }
        self.vocab_size = model.config.vocab_size
        self.kv_pages = init_kv_pages(model.config, config.num_pages, config.page_size)
        self.pool = jaxpaged.create_pool(
            config.num_pages, config.page_size, config.max_seqs, config.pages_per_seq
        )
        self.scheduler = Scheduler(config)
        self.stats = Stats()
        self._next_id = 0

    def step_fn(self, decode: bool):
        """The jitted step of one kind: `step_fn(decode)(param_leaves, kv_pages, pool, inputs,
        *, decode, all_logits, implementation) -> (kv_pages, pool, StepOutputs)`, pages and
        pool donated."""
        return self._step_fns[decode]

    def add_request(self, prompt: Seq[int], params: SamplingParams) -> Sequence:
        total = len(prompt) + params.max_new_tokens
        if not prompt or params.max_new_tokens < 1 or total > self.config.max_model_len:
            raise ValueError(
                f"need a non-empty prompt, max_new_tokens >= 1 and prompt + "
                f"max_new_tokens <= max_model_len={self.config.max_model_len}; got "
                f"{len(prompt)} + {params.max_new_tokens}"
            )
        seq = Sequence(self._next_id, [int(t) for t in prompt], len(prompt), params)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def step(self, *, record_prompt_logits: bool = False) -> list[Sequence]:
        """Run one step; returns the sequences it finished."""
        plan = self.scheduler.schedule()
        self._release_pending()
        if not plan.chunks:
            return []
        inputs = self._inputs(plan)
        start = time.perf_counter()
        with jaxpaged.quiet_triton_deprecation():
            self.kv_pages, self.pool, out = self.step_fn(plan.decode)(
                self.param_leaves,
                self.kv_pages,
                self.pool,
                inputs,
                decode=plan.decode,
                all_logits=record_prompt_logits and not plan.decode,
                implementation=self.implementation,
            )
        self.stats.dispatch_time += time.perf_counter() - start
        tokens, logprobs, ok = jax.device_get((out.tokens, out.logprobs, out.ok))
        elapsed = time.perf_counter() - start
        self.stats.steps += 1
        if not ok:
            self.stats.failed_steps += 1
            self.scheduler.on_failed_step()
            return []
        if record_prompt_logits:
            self._record_logits(plan, np.asarray(out.logits))
        self._count(plan, elapsed)
        finished = self.scheduler.update(plan, tokens, logprobs)
        self._release_pending()
        return finished

    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        *,
        record_prompt_logits: bool = False,
    ) -> list[Sequence]:
        """Run every prompt to completion; returns their sequences in the prompts' order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.scheduler.has_work():
            self.step(record_prompt_logits=record_prompt_logits)
        return seqs

    def _inputs(self, plan: Plan) -> StepInputs:
        num_seq_slots = self.config.max_seqs
        num_tokens = num_seq_slots if plan.decode else self.config.max_tokens_per_step
        tokens = np.zeros(num_tokens, np.int32)
        seq_ids = np.full(num_seq_slots, -1, np.int32)
        cu_q_lens = np.zeros(num_seq_slots + 1, np.int32)
        temperatures = np.zeros(num_seq_slots, np.float32)
        seeds = np.zeros(num_seq_slots, np.uint32)
        offset = 0
        for i, c in enumerate(plan.chunks):
            tokens[offset : offset + c.length] = c.seq.tokens[c.start : c.start + c.length]
            offset += c.length
            seq_ids[i] = c.seq.slot
            cu_q_lens[i + 1] = offset
            temperatures[i] = c.seq.params.temperature
            seeds[i] = c.seq.params.seed
        cu_q_lens[len(plan.chunks) + 1 :] = offset
        return StepInputs(
            tokens, seq_ids, cu_q_lens, np.int32(len(plan.chunks)), temperatures, seeds
        )

    def _release_pending(self) -> None:
        # Padded to max_seqs ids so that `release` compiles once.
        if not self.scheduler.to_release:
            return
        ids = np.full(self.config.max_seqs, -1, np.int32)
        slots = np.unique(self.scheduler.to_release)
        ids[: len(slots)] = slots
        self.pool = jaxpaged.release(self.pool, ids)
        self.scheduler.to_release.clear()

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

    def _count(self, plan: Plan, elapsed: float) -> None:
        if all(c.is_decode for c in plan.chunks):
            self.stats.decode_tokens += len(plan.chunks)
            self.stats.decode_time += elapsed
            self.stats.decode_steps += 1
        else:
            self.stats.prefill_tokens += sum(c.length for c in plan.chunks if not c.is_decode)
            self.stats.prefill_time += elapsed
            self.stats.prefill_steps += 1
