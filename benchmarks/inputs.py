"""What the suites time: random inputs on paged KV, and the functions, ours and the anchors.

bf16, Hq=32, Hkv=8, D=128. The page pool of a case holds exactly its batch's pages, in random
order: cuDNN's paged attention requires such a pool, and every implementation then reads the
same bytes. Each function takes its inputs' arrays positionally, so a suite times any of them
the same way (`benchmarks.common.Runner`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import (
    find_prefix_groups,
    paged_decode_attention,
    plan_cascade,
    ragged_paged_attention,
)
from pallas_kernels.mosaic import paged_decode as mosaic_decode
from pallas_kernels.triton import paged_decode as triton_decode

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = jnp.bfloat16
SCALE = HEAD_DIM**-0.5
PREFILL_PAGE_SIZE = 64


# Decode: one query token per sequence.


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    name: str
    batch: int
    ctx: int  # kv_len of every sequence, or the upper bound of U[1, ctx] when ragged
    page_size: int
    ragged: bool = False
    xla: bool = False  # also time the XLA reference


@dataclasses.dataclass
class DecodeInputs:
    q: jax.Array  # [B, Hq, D]
    k: jax.Array  # [P, page_size, Hkv, D], P = B * pages_per_seq
    v: jax.Array
    kv_lens: jax.Array  # i32[B]
    table: jax.Array  # i32[B, pages_per_seq], a permutation of the pool's pages
    kv_bytes: int  # unique K and V bytes of the live tokens

    def args(self) -> tuple[jax.Array, ...]:
        return self.q, self.k, self.v, self.kv_lens, self.table


def kv_cache_bytes(num_tokens: int) -> int:
    """K and V bytes of `num_tokens` cached tokens."""
    return num_tokens * NUM_KV_HEADS * HEAD_DIM * 2 * jnp.dtype(DTYPE).itemsize


def make_decode_inputs(case: DecodeCase) -> DecodeInputs:
    rng = np.random.default_rng(0)
    pages_per_seq = case.ctx // case.page_size
    num_pages = case.batch * pages_per_seq
    shape = (num_pages, case.page_size, NUM_KV_HEADS, HEAD_DIM)
    key_k, key_v = jax.random.split(jax.random.key(case.page_size))
    if case.ragged:
        lens = rng.integers(1, case.ctx + 1, size=case.batch)
    else:
        lens = np.full(case.batch, case.ctx)
    table = rng.permutation(num_pages).reshape(case.batch, pages_per_seq)
    return DecodeInputs(
        q=jax.random.normal(jax.random.key(1), (case.batch, NUM_Q_HEADS, HEAD_DIM), DTYPE),
        k=jax.random.normal(key_k, shape, DTYPE),
        v=jax.random.normal(key_v, shape, DTYPE),
        kv_lens=jnp.asarray(lens, jnp.int32),
        table=jnp.asarray(table, jnp.int32),
        kv_bytes=kv_cache_bytes(int(lens.sum())),
    )


def triton_decode_fn(interpret: bool) -> Callable:
    """Our Triton split-KV decode kernel with its defaults."""

    def fn(q, k, v, kv_lens, table):
        return triton_decode.paged_decode_attention(
            q, k, v, kv_lens, table, num_splits=None, config=None, interpret=interpret
        )[0]

    return fn


def mosaic_decode_fn(q, k, v, kv_lens, table):
    """Our Mosaic GPU decode kernel with its defaults (GPU only)."""
    return mosaic_decode.paged_decode_attention(
        q, k, v, kv_lens, table, num_splits=None, sm_scale=SCALE, config=None
    )


def public_triton_decode_fn(interpret: bool) -> Callable:
    """The Triton decode kernel through `jaxpaged.paged_decode_attention`."""

    def fn(q, k, v, kv_lens, table):
        return paged_decode_attention(
            q, k, v, kv_lens, table, implementation="triton", interpret=interpret
        )

    return fn


def cudnn_decode_fn(q, k, v, kv_lens, table):
    """cuDNN paged decode (a private JAX API: it may be missing)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    table = table[:, None, :, None]
    out = fa.paged_attention(
        q[:, None],
        k,
        v,
        jnp.ones_like(kv_lens),
        kv_lens,
        table,
        table,
        scale=SCALE,
        mask_type=fa.MaskType.PADDING,
    )
    return out[:, 0]


def jax_pallas_decode_fn(k_splits: int, interpret: bool) -> Callable:
    """JAX's deprecated Pallas-Triton `paged_attention`; K/V in its [Hkv, P, page_size, D]
    layout."""

    def fn(q, k, v, kv_lens, table):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        return paged_attention(q, k, v, table, kv_lens, k_splits=k_splits, interpret=interpret)

    return fn


def xla_decode_fn(q, k, v, kv_lens, table):
    return paged_decode_attention(q, k, v, kv_lens, table, implementation="xla")


def make_shared_prefix_inputs(
    prompts: int, samples: int, shared: int, private: int, page_size=16, max_groups=None
):
    """`prompts * samples` decode sequences of `shared + private` tokens: each prompt's first
    `shared` (whole pages) in pages all its samples list, then `private` of their own. Returns
    `shared_prefix_decode_attention`'s `(q, k, v, kv_lens, table, plan)` (a group per prompt,
    planned as the engine does once per step for all layers, with `max_groups` group slots)
    and the table of the same batch in per-sample copies of the shared pages (the same K/V)."""
    batch, kv_len = prompts * samples, shared + private
    pages_per_seq, num_shared = -(-kv_len // page_size), shared // page_size
    table = np.random.default_rng(0).permutation(batch * pages_per_seq).reshape(batch, -1)
    leaders = table[np.arange(batch) // samples * samples, :num_shared]
    keys = jax.random.split(jax.random.key(2), 3)
    shape = (batch * pages_per_seq, page_size, NUM_KV_HEADS, HEAD_DIM)
    k, v = (jax.random.normal(key, shape, DTYPE) for key in keys[1:])
    k, v = (x.at[table[:, :num_shared]].set(x[leaders]) for x in (k, v))  # the copies
    shared_table = jnp.asarray(np.concatenate([leaders, table[:, num_shared:]], 1), jnp.int32)
    kv_lens = jnp.full((batch,), kv_len, jnp.int32)
    groups = find_prefix_groups(
        shared_table, kv_lens, page_size, max_group_size=samples, min_saved_tokens=0
    )
    plan = plan_cascade(groups, shared_table, kv_lens, page_size, max_groups=max_groups)
    q = jax.random.normal(keys[0], (batch, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    return (q, k, v, kv_lens, shared_table, plan), jnp.asarray(table, jnp.int32)


# Prefill and mixed batches: one ragged call over sequences of several tokens each.


@dataclasses.dataclass(frozen=True)
class Batch:
    """A ragged batch over a page pool; `seqs` lists (q_len, kv_len)."""

    name: str
    seqs: tuple[tuple[int, int], ...]

    @property
    def visible_pairs(self) -> int:
        # Causal: token i of a sequence sits at kv_len - q_len + i and sees that many keys + 1.
        return sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in self.seqs)

    @property
    def flops(self) -> int:
        return 4 * HEAD_DIM * NUM_Q_HEADS * self.visible_pairs


@dataclasses.dataclass
class PrefillInputs:
    q: jax.Array  # [T, Hq, D]
    k: jax.Array  # [P, page_size, Hkv, D]
    v: jax.Array
    kv_lens: jax.Array  # i32[S]
    table: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S+1]

    def args(self) -> tuple[jax.Array, ...]:
        num_seqs = jnp.asarray(self.kv_lens.shape[0], jnp.int32)
        return self.q, self.k, self.v, self.kv_lens, self.table, self.cu_q_lens, num_seqs


def make_prefill_inputs(batch: Batch, seed: int = 0) -> PrefillInputs:
    q_lens = np.array([q for q, _ in batch.seqs])
    kv_lens = np.array([kv for _, kv in batch.seqs])
    pages_per_seq = int(-(-kv_lens.max() // PREFILL_PAGE_SIZE))
    num_pages = len(batch.seqs) * pages_per_seq
    table = np.random.default_rng(seed).permutation(num_pages).reshape(-1, pages_per_seq)
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, PREFILL_PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return PrefillInputs(
        q=jax.random.normal(keys[0], (int(q_lens.sum()), NUM_Q_HEADS, HEAD_DIM), DTYPE),
        k=jax.random.normal(keys[1], shape, DTYPE),
        v=jax.random.normal(keys[2], shape, DTYPE),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        table=jnp.asarray(table, jnp.int32),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    )


def mixed_batches(num_chunks: int, chunk: int, prefix: int, num_decode: int):
    """A mixed step and its two parts, as (mixed, chunks, decodes): `num_chunks` chunks of
    `chunk` tokens on `prefix` cached tokens, and `num_decode` single tokens on contexts of
    U[3/4, 5/4] `prefix`."""
    rng = np.random.default_rng(0)
    chunks = tuple((chunk, prefix + chunk) for _ in range(num_chunks))
    ctx = rng.integers(3 * prefix // 4, 5 * prefix // 4 + 1, size=num_decode)
    decodes = tuple((1, int(n)) for n in ctx)
    return (
        Batch("mixed", chunks + decodes),
        Batch("mixed:chunks", chunks),
        Batch("mixed:decodes", decodes),
    )


def dense_kv(inputs: PrefillInputs) -> tuple[jax.Array, jax.Array]:
    """K, V [S, L, Hkv, D] in sequence order, for the dense anchors (gathered untimed)."""

    def gather(pages):
        return pages[inputs.table].reshape(inputs.table.shape[0], -1, NUM_KV_HEADS, HEAD_DIM)

    return gather(inputs.k), gather(inputs.v)


def ragged_fn(implementation: str, interpret: bool = False) -> Callable:
    """`jaxpaged.ragged_paged_attention` by one implementation (ours or the XLA reference)."""

    def fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
        return ragged_paged_attention(
            q,
            k,
            v,
            kv_lens,
            table,
            cu_q_lens,
            num_seqs,
            implementation=implementation,
            interpret=interpret,
        )

    return fn


def _dense_shape(x: jax.Array, batch: int) -> jax.Array:
    return x.reshape(batch, -1, *x.shape[1:])


def cudnn_paged_prefill_fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
    """cuDNN paged prefill (a private JAX API); every sequence has q_len == kv_len."""
    del cu_q_lens, num_seqs
    from jax._src.cudnn import fused_attention_stablehlo as fa

    num_seqs = kv_lens.shape[0]
    table = table[:, None, :, None]
    out = fa.paged_attention(
        _dense_shape(q, num_seqs),
        k,
        v,
        kv_lens,
        kv_lens,
        table,
        table,
        scale=SCALE,
        mask_type=fa.MaskType.PADDING_CAUSAL,
    )
    return out.reshape(q.shape)


def cudnn_dense_prefill_fn(q, k, v, kv_lens):
    """cuDNN dense causal attention on contiguous K/V [S, L, Hkv, D] (`dense_kv`)."""
    out = jax.nn.dot_product_attention(
        _dense_shape(q, kv_lens.shape[0]), k, v, is_causal=True, implementation="cudnn"
    )
    return out.reshape(q.shape)


def mosaic_fa3_fn(q, k, v):
    """JAX's Mosaic GPU FA3 forward, causal, on dense [B, T, H, D] fp16 inputs (it fails on
    bf16 in jax 0.11.2)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=True
    )
    return attention_mgpu.attention(q, k, v, config)
