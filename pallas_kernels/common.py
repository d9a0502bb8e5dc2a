"""Math shared by every attention kernel and the reference: metadata sanitizing, masks,
the online-softmax step and the merge of partial attention states.

All functions here are plain `jnp` so that they trace the same inside a Pallas kernel body
(Triton or Mosaic GPU lowering) and in XLA.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
# Streaming multiprocessors of the H100 SXM and H200: the split rules' target when no GPU is
# attached (interpret mode, cross-lowering).
H200_NUM_SMS = 132
LN2 = math.log(2.0)


class RaggedMetadata(NamedTuple):
    """Batch metadata clamped so that no index can leave its array.

    For valid metadata this is the identity (apart from padding sequences, which become
    empty). For invalid metadata inside `jit` the numbers may be wrong, but every read and
    write stays in bounds.
    """

    cu_q_lens: jax.Array  # i32[S+1], starts at 0, non-decreasing, <= T; constant from num_seqs on
    kv_lens: jax.Array  # i32[S], in [0, pages_per_seq * page_size]; 0 for padding sequences
    page_indices: jax.Array  # i32[S, pages_per_seq], in [0, P)
    num_seqs: jax.Array  # i32[], in [0, S]


def sanitize_metadata(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    num_pages: int,
    page_size: int,
) -> RaggedMetadata:
    num_seq_slots, pages_per_seq = page_indices.shape
    n = jnp.clip(jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32), 0, num_seq_slots)
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens).at[0].set(0)
    cu = jnp.where(jnp.arange(num_seq_slots + 1) <= n, cu, cu[n])
    cu = lax.cummax(cu)
    live = jnp.arange(num_seq_slots) < n
    kv = jnp.where(live, jnp.clip(kv_lens.astype(jnp.int32), 0, pages_per_seq * page_size), 0)
    pages = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    return RaggedMetadata(cu, kv, pages, n)


def device_num_sms() -> int:
    """SMs of the default device when it is a GPU, else `H200_NUM_SMS`."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return getattr(device, "core_count", H200_NUM_SMS)
    return H200_NUM_SMS


def apply_soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(logits / cap)`; the identity when `cap` is None."""
    if cap is None:
        return logits
    return cap * jnp.tanh(logits / cap)


def logits_base2(scores: jax.Array, sm_scale: float, logits_soft_cap: float | None) -> jax.Array:
    """Base-2 logits (`online_softmax_step`'s input) from raw Q K^T scores: one multiply when
    there is no soft cap."""
    if logits_soft_cap is None:
        return scores * (sm_scale * LOG2E)
    return apply_soft_cap(scores * sm_scale, logits_soft_cap) * LOG2E


def visible(
    q_pos: jax.Array,
    k_pos: jax.Array,
    kv_len: jax.Array,
    *,
    causal: bool,
    sliding_window: int | None,
) -> jax.Array:
    """Which (query, key) pairs are attended: `k < kv_len`, bottom-right causal `k <= q`, and
    `k > q - sliding_window`. `q_pos` and `k_pos` broadcast against each other."""
    ok = k_pos < kv_len
    if causal:
        ok = ok & (k_pos <= q_pos)
    if sliding_window is not None:
        ok = ok & (k_pos > q_pos - sliding_window)
    return ok


def dot_f32(a: jax.Array, b: jax.Array, *, contract_b: int) -> jax.Array:
    """`a @ b` (contract_b=0) or `a @ b.T` (contract_b=1) accumulated in float32. HIGHEST makes
    float32 dots IEEE (Triton would pick TF32); it does not change 16-bit dots."""
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def online_softmax_step(
    m_prev: jax.Array, l_prev: jax.Array, logits2: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One flash-attention step in base 2.

    `logits2` [M, N] are logits times log2(e) with masked entries at -inf; `m_prev`, `l_prev`
    [M] the running max (base 2) and sum. Returns `(m_new, l_new, alpha, p)`: rescale the
    accumulator by `alpha[:, None]` and add `p @ v`. A row that has seen only masked keys keeps
    `m = -inf`, `l = 0` and gets `p = 0`, `alpha = 0` (never `exp(-inf + inf)` = NaN).
    """
    m_new = jnp.maximum(m_prev, jnp.max(logits2, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(logits2 - m_safe[:, None])
    l_new = alpha * l_prev + jnp.sum(p, axis=-1)
    return m_new, l_new, alpha, p


def merge_online_states(a, b):
    """The online-softmax state `(acc, m, l)` (`online_softmax_step`'s, base 2, acc [M, D]
    unnormalized) of the keys of two states `a` and `b` together. Rows that neither has seen
    a visible key in keep `m = -inf`, `l = 0` (never `exp(-inf + inf)` = NaN)."""
    (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
    m = jnp.maximum(m_a, m_b)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    alpha_a, alpha_b = jnp.exp2(m_a - m_safe), jnp.exp2(m_b - m_safe)
    acc = acc_a * alpha_a[:, None] + acc_b * alpha_b[:, None]
    return acc, m, alpha_a * l_a + alpha_b * l_b


def finalize(acc: jax.Array, m: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Normalized output [M, D] and natural-log LSE [M] from the online-softmax state; rows that
    saw no visible key give 0 and -inf."""
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc / l_safe[:, None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
    return out, lse


def merge_partial_states(
    outs: jax.Array, lses: jax.Array, axis: int = 0
) -> tuple[jax.Array, jax.Array]:
    """Merge normalized partial outputs `outs` [..., D] with their LSEs `lses` [...] along
    `axis` (of `lses`; `outs` has one trailing dim more). Empty partials (LSE -inf) are the
    identity; all-empty gives output 0 and LSE -inf. Computes in float32."""
    outs = outs.astype(jnp.float32)
    lses = lses.astype(jnp.float32)
    m = jnp.max(lses, axis=axis, keepdims=True)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lses - m_safe)
    denom = jnp.sum(w, axis=axis)
    empty = denom == 0.0
    weighted = jnp.sum(jnp.where(w[..., None] > 0, w[..., None] * outs, 0.0), axis=axis)
    out = weighted / jnp.where(empty, 1.0, denom)[..., None]
    lse = jnp.where(
        empty, -jnp.inf, jnp.squeeze(m_safe, axis) + jnp.log(jnp.where(empty, 1.0, denom))
    )
    return out, lse


def merge_states(outs, lses) -> tuple[jax.Array, jax.Array]:
    """`merge_partial_states` of a few states given as sequences, written out elementwise (no
    stack, no reduction over a short axis), for XLA to fuse with the gathers that feed it (the
    cascade's merge: two kernels, benchmarks/NOTES.md run 77). outs: [..., D] each, lses:
    [...] each; float32 results."""
    lses = [lse.astype(jnp.float32) for lse in lses]
    m = functools.reduce(jnp.maximum, lses)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    weights = [jnp.exp(lse - m_safe) for lse in lses]
    denom = functools.reduce(jnp.add, weights)
    empty = denom == 0.0
    # An empty state's output is ignored, even if NaN.
    parts = [
        jnp.where(w[..., None] > 0, w[..., None] * out.astype(jnp.float32), 0.0)
        for w, out in zip(weights, outs, strict=True)
    ]
    out = functools.reduce(jnp.add, parts) / jnp.where(empty, 1.0, denom)[..., None]
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, denom)))
    return out, lse


def merge_splits(outs: jax.Array, lses: jax.Array, *, out_dtype) -> tuple[jax.Array, jax.Array]:
    """The split-KV merge of a decode kernel in XLA: `merge_partial_states` along the splits.

    Args:
      outs: f32[X, splits, Y, D] normalized partial outputs.
      lses: f32[X, splits, Y] their natural-log LSEs; -inf marks an empty partial (its output
        row is ignored, even if NaN).
      out_dtype: dtype of the merged output.

    Returns:
      `out` [X, Y, D] in `out_dtype` and `lse` f32[X, Y]; rows whose partials are all empty
      give 0 and -inf.
    """
    out, lse = merge_partial_states(outs, lses, axis=1)
    return out.astype(out_dtype), lse


_POISON = [False]


@contextlib.contextmanager
def poison_outputs():
    """Inside this context, kernels traced from now on start from NaN-filled (or int-min)
    output buffers instead of uninitialized ones, so that tests see every element a kernel
    failed to write. A kernel launch asks `poisoned_outputs` for such buffers and writes into
    them in place: a `pallas_call` through `alias_outputs`, a Mosaic GPU kernel through
    `pallas_kernels.mosaic.common.launch`. Jitted functions that trace kernels take
    `poison_enabled()` as a static argument, so that the context retraces them."""
    _POISON[0], before = True, _POISON[0]
    try:
        yield
    finally:
        _POISON[0] = before


def poison_enabled() -> bool:
    return _POISON[0]


def poisoned_outputs(shapes) -> list[jax.Array] | None:
    """Inside `poison_outputs()`, buffers of `shapes` (`jax.ShapeDtypeStruct`s) filled with
    NaN (floats) or the minimum integer; else None (the kernel allocates its outputs)."""
    if not poison_enabled():
        return None
    fills = []
    for shape in shapes:
        dtype = jnp.dtype(shape.dtype)
        fill = jnp.nan if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min
        fills.append(jnp.full(shape.shape, fill, dtype))
    return fills


def alias_outputs(inputs: list, outputs) -> tuple[list, dict[int, int]]:
    """`pallas_call` inputs with `outputs` appended (buffers the kernel updates in place, e.g.
    `poisoned_outputs(...)`), and the `input_output_aliases` that say so. The kernel body
    finds its outputs at `refs[-len(outputs):]` either way. `outputs=None`: no change."""
    if outputs is None:
        return inputs, {}
    return [*inputs, *outputs], {len(inputs) + i: i for i in range(len(outputs))}
