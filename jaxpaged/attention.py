"""Public attention ops, their static checks and the jitted call into a backend.

`implementation=` picks a backend ("xla", "triton", "mosaic"); which ones exist, where they
run and which one `implementation=None` takes is `jaxpaged.dispatch`'s table.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jaxpaged import dispatch
from pallas_kernels.common import merge_states, poison_enabled

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def available_implementations(op: str = "ragged") -> tuple[str, ...]:
    """Backends usable for `op` ("ragged" or "decode") on the default device, best first."""
    return dispatch.available(op, dispatch.default_device())


def resolve_implementation(
    op: str,
    implementation: str | None = None,
    dtype=jnp.bfloat16,
    *,
    head_dim: int | None = None,
    page_size: int | None = None,
    num_seqs: int | None = None,
    num_kv_heads: int | None = None,
    max_kv_len: int | None = None,
) -> str:
    """The backend that `implementation` means for `op` ("ragged" or "decode") and inputs of
    `dtype` on the default device.

    `None` resolves by `jaxpaged.dispatch.TABLE` to the best available backend that takes
    such inputs: `head_dim`, `page_size` and, for decode only, `num_seqs`, `num_kv_heads` and
    `max_kv_len` (the tokens a page-table row holds) are what the rules look at, where given.
    An explicit name is returned as is, or raises `ValueError` listing what is available.
    """
    decode_shape = dict(num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_kv_len=max_kv_len)
    if op != "decode" and (given := sorted(k for k, v in decode_shape.items() if v is not None)):
        raise TypeError(f"resolve_implementation({op!r}) got unexpected keywords {given}")
    device = dispatch.default_device()
    if implementation is None:
        call = dispatch.Call(jnp.dtype(dtype), head_dim, page_size, **decode_shape)
        return dispatch.choose(op, call, device)
    available = dispatch.available(op, device)
    if implementation not in available:
        known = [row.name for row in dispatch.backends(op)]
        why = "unknown" if implementation not in known else "not available on this machine"
        raise ValueError(f"implementation={implementation!r} is {why}; available: {available}")
    return implementation


@contextlib.contextmanager
def quiet_triton_deprecation():
    """Silence JAX's `jax-pallas-triton` deprecation warning for our own kernels.

    The warning fires when a Pallas Triton kernel is lowered. Our public ops lower inside this
    context when they are called outside `jit`; jitted step functions that call them should
    compile inside it too (the model's steps do).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
        )
        yield


def _check_kv(q, k_pages, v_pages, kv_lens, page_indices) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must have shape [T, Hq, D]; got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must have shape [P, page_size, Hkv, D]; got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages must have the shape of k_pages {k_pages.shape}; got {v_pages.shape}"
        )
    if jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float32, bfloat16 or float16; got {q.dtype}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise TypeError(
            f"k_pages and v_pages must have q's dtype {q.dtype}; "
            f"got {k_pages.dtype}, {v_pages.dtype}"
        )
    if q.shape[2] != k_pages.shape[3]:
        raise ValueError(
            f"head dim D of q ({q.shape[2]}) must equal that of k_pages ({k_pages.shape[3]})"
        )
    num_q_heads, num_kv_heads = q.shape[1], k_pages.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"Hq (q.shape[1] = {num_q_heads}) must be a multiple of Hkv "
            f"(k_pages.shape[2] = {num_kv_heads})"
        )
    if k_pages.shape[0] == 0 or k_pages.shape[1] == 0:
        raise ValueError(f"k_pages must hold at least one page of one slot; got {k_pages.shape}")
    _check_table(kv_lens, page_indices)
    if kv_lens.shape[0] == 0 or page_indices.shape[1] == 0:
        raise ValueError(
            f"need at least one sequence slot and one page per sequence; got page_indices "
            f"shape {page_indices.shape}"
        )


def _check_table(kv_lens, page_indices) -> None:
    """kv_lens i32[S] and page_indices i32[S, pages_per_seq], one row per sequence."""
    _check_index("kv_lens", kv_lens, 1)
    _check_index("page_indices", page_indices, 2)
    if page_indices.shape[0] != kv_lens.shape[0]:
        raise ValueError(
            f"page_indices must have one row per sequence: shape[0] {page_indices.shape[0]} "
            f"!= len(kv_lens) {kv_lens.shape[0]}"
        )


def _check_index(name: str, x, ndim: int) -> None:
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name} must be an int32 array; got {getattr(x, 'dtype', type(x))}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s); got shape {x.shape}")


def _check_options(sm_scale, sliding_window, logits_soft_cap) -> None:
    if sm_scale is not None and not (
        isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)
    ):
        raise ValueError(f"sm_scale must be a finite Python float or None; got {sm_scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1; got {sliding_window!r}")
    if logits_soft_cap is not None and not (
        isinstance(logits_soft_cap, (int, float))
        and math.isfinite(logits_soft_cap)
        and logits_soft_cap > 0
    ):
        raise ValueError(f"logits_soft_cap must be None or a float > 0; got {logits_soft_cap!r}")


def _as_num_seqs(num_seqs) -> jax.Array:
    if isinstance(num_seqs, int) and not isinstance(num_seqs, bool):
        return jnp.asarray(num_seqs, jnp.int32)
    _check_index("num_seqs", num_seqs, num_seqs.ndim if hasattr(num_seqs, "ndim") else 0)
    if num_seqs.shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar or have shape [1]; got shape {num_seqs.shape}")
    return num_seqs


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    interpret: bool = False,
    config: Any = None,
    short_sequences: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a flat ragged batch of query chunks over paged KV (bottom-right causal).

    Serves prefill, chunked prefill and decode tokens in one call.

    Args:
      q: [T, Hq, D] float32/bfloat16/float16, the new tokens of all sequences, packed.
      k_pages, v_pages: [P, page_size, Hkv, D], q's dtype: one layer's page pool.
      kv_lens: i32[S], each sequence's KV length including its new tokens.
      page_indices: i32[S, pages_per_seq]; position j of sequence s lives in page
        `page_indices[s, j // page_size]`, slot `j % page_size`.
      cu_q_lens: i32[S+1], token offsets: sequence s owns tokens `cu_q_lens[s]:cu_q_lens[s+1]`.
      num_seqs: i32 scalar or i32[1]; sequences from `num_seqs` on and tokens from
        `cu_q_lens[num_seqs]` on are padding.
      sm_scale: logits scale, default `1/sqrt(D)`.
      causal: token i of a sequence with q_len new tokens sits at `p = kv_len - q_len + i` and
        sees keys `j <= p`; with False it sees all `j < kv_len`.
      sliding_window: also require `j > p - sliding_window`.
      logits_soft_cap: `cap * tanh(logits / cap)` before masking.
      return_lse: also return the natural-log log-sum-exp f32[T, Hq].
      implementation: None (best for the device), "xla", "triton" or "mosaic".
      interpret: run a Pallas kernel in interpret mode (forced where there is no GPU).
      config: the backend's tuning config, e.g. a
        `pallas_kernels.triton.ragged_prefill.PrefillConfig`.
      short_sequences: let the kernels send sequences of one (Mosaic) or a few (Triton) new
        tokens, the decode tokens of a mixed batch, to a launch of their own. False (a batch
        of prompt chunks, with no decode tokens) saves that launch's kernels; results are the
        same either way, and the reference ignores it.

    Returns:
      `out` [T, Hq, D] in q's dtype, and `lse` f32[T, Hq] when `return_lse`. Rows with no
      visible key and padding tokens give 0 and LSE -inf.
    """
    _check_kv(q, k_pages, v_pages, kv_lens, page_indices)
    _check_index("cu_q_lens", cu_q_lens, 1)
    if cu_q_lens.shape[0] != kv_lens.shape[0] + 1:
        raise ValueError(
            f"cu_q_lens must have S+1 = {kv_lens.shape[0] + 1} entries; got {cu_q_lens.shape[0]}"
        )
    num_seqs = _as_num_seqs(num_seqs)
    _check_options(sm_scale, sliding_window, logits_soft_cap)
    name = resolve_implementation(
        "ragged", implementation, q.dtype, head_dim=q.shape[-1], page_size=k_pages.shape[1]
    )
    out, lse = _attend(
        (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs),
        op="ragged",
        implementation=name,
        options=dict(
            sm_scale=_scale(sm_scale, q),
            causal=bool(causal),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        ),
        tuning=dict(
            config=config, interpret=_interpret(interpret), short_sequences=bool(short_sequences)
        ),
    )
    return (out, lse) if return_lse else out


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    num_splits: int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    interpret: bool = False,
    config: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """One new query token per sequence over paged KV (split-KV decode).

    Args:
      q: [S, Hq, D] float32/bfloat16/float16, the new token of every sequence slot.
      k_pages, v_pages, page_indices, sm_scale, sliding_window, logits_soft_cap, return_lse,
        implementation, interpret, config: as `ragged_paged_attention`.
      kv_lens: i32[S], KV length including the new token; 0 marks an inactive slot.
      num_splits: KV splits per sequence; None picks a count from the batch shape.

    Returns:
      `out` [S, Hq, D] in q's dtype, and `lse` f32[S, Hq] when `return_lse`; inactive slots
      give 0 and -inf.
    """
    _check_kv(q, k_pages, v_pages, kv_lens, page_indices)
    if q.shape[0] != kv_lens.shape[0]:
        raise ValueError(
            f"q must have one token per sequence: q.shape[0] {q.shape[0]} != len(kv_lens) "
            f"{kv_lens.shape[0]}"
        )
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1; got {num_splits!r}")
    _check_options(sm_scale, sliding_window, logits_soft_cap)
    name = resolve_implementation(
        "decode",
        implementation,
        q.dtype,
        head_dim=q.shape[-1],
        page_size=k_pages.shape[1],
        num_seqs=q.shape[0],
        num_kv_heads=k_pages.shape[2],
        max_kv_len=page_indices.shape[1] * k_pages.shape[1],
    )
    out, lse = _attend(
        (q, k_pages, v_pages, kv_lens, page_indices),
        op="decode",
        implementation=name,
        options=dict(
            sm_scale=_scale(sm_scale, q),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        ),
        tuning=dict(num_splits=num_splits, config=config, interpret=_interpret(interpret)),
    )
    return (out, lse) if return_lse else out


def _scale(sm_scale: float | None, q: jax.Array) -> float:
    return float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)


def _interpret(interpret: bool) -> bool:
    """Pallas kernels run in interpret mode where there is no GPU."""
    return bool(interpret) or dispatch.default_device().platform != "gpu"


def _attend(arrays, *, op: str, implementation: str, options: dict, tuning: dict):
    """Runs backend `implementation` of `op` on `arrays` under `jit`, with `options` (and
    `tuning`, which only the kernels take) as static arguments."""
    if dispatch.tuned(op, implementation):
        options = {**options, **tuning}
    return _attend_jit(
        arrays,
        op=op,
        implementation=implementation,
        options=tuple(sorted(options.items())),
        poison=poison_enabled(),
    )


@functools.partial(jax.jit, static_argnames=("op", "implementation", "options", "poison"))
def _attend_jit(arrays, *, op, implementation, options, poison):
    del poison  # a static key only: kernels read it while tracing (see common.poison_outputs)
    with quiet_triton_deprecation():
        return dispatch.load(op, implementation)(*arrays, **dict(options))


def merge_attention_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combine attention over two disjoint key sets into attention over their union.

    Args:
      out_a, out_b: [T, H, D] normalized outputs. lse_a, lse_b: f32[T, H] their LSEs.
    Returns:
      `(out, lse)`: out in out_a's dtype, lse f32. Two empty states (LSE -inf) give 0 and -inf.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attention_states needs out [..., D] and lse [...] of matching shapes; got "
            f"{out_a.shape}, {lse_a.shape}, {out_b.shape}, {lse_b.shape}"
        )
    out, lse = merge_states((out_a, out_b), (lse_a, lse_b))
    return out.astype(out_a.dtype), lse
