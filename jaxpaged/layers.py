"""A Flax NNX attention layer over paged KV, for users' own decoders.

One step's batch metadata (`StepMetadata`, built once per step and shared by every layer) and one
layer's pages go in; the layer projects q/k/v, rotates them by each token's position, appends
the new K/V to the pages and attends:

    meta = StepMetadata.build(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens=T)
    out, k_pages, v_pages = attn(x, k_pages, v_pages, meta)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpaged import dispatch
from jaxpaged.attention import (
    paged_decode_attention,
    quiet_triton_deprecation,
    ragged_paged_attention,
    resolve_implementation,
)
from jaxpaged.kv_cache import append_kv, kv_slots, write_kv
from jaxpaged.reference import token_positions
from jaxpaged.shared_prefix import CascadePlan, PrefixGroups, shared_prefix_decode_attention


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=(
        "kv_lens",
        "page_indices",
        "cu_q_lens",
        "num_seqs",
        "positions",
        "kv_slots",
        "prefix_groups",
    ),
    meta_fields=("decode", "prompt_only"),
)
@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """The batch metadata of one step, shared by every layer (a pytree; `decode` and
    `prompt_only` are static).

    kv_lens: i32[S], KV length of each sequence including this step's tokens.
    page_indices: i32[S, pages_per_seq], each sequence's pages.
    cu_q_lens: i32[S+1], sequence s owns tokens `cu_q_lens[s]:cu_q_lens[s+1]`.
    num_seqs: i32[], live sequences; rows from `num_seqs` on are padding.
    positions: i32[T], the position `kv_len - q_len + i` of every token (0 for padding).
    kv_slots: i32[T], the pool slot each token's K/V is written to (`jaxpaged.kv_slots`), or
      None: each layer then computes them again (`append_kv`).
    decode: every live sequence has exactly one token and token s belongs to sequence s
      (T == S); the layer then calls the split-KV `paged_decode_attention`.
    prefix_groups: in a decode step, the sequences that share their first pages
      (`jaxpaged.find_prefix_groups` over these kv_lens and page_indices, or their
      `jaxpaged.plan_cascade`, which saves every layer the same work); the layer then calls
      `shared_prefix_decode_attention`, which reads those pages once per group (not under a
      sliding window). None: no sharing.
    prompt_only: the step holds prompt chunks and no decode tokens; ragged attention then
      skips its launch for sequences of one or a few tokens (`short_sequences=False`), which
      changes no result (a chunk of one token still gets its attention, from the main launch).
    """

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    positions: jax.Array
    kv_slots: jax.Array | None = None
    decode: bool = False
    prefix_groups: PrefixGroups | CascadePlan | None = None
    prompt_only: bool = False

    @classmethod
    def build(
        cls,
        kv_lens: jax.Array,
        page_indices: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array | int,
        *,
        num_tokens: int,
        decode: bool = False,
        pool_shape: tuple[int, int] | None = None,
        prompt_only: bool = False,
    ) -> StepMetadata:
        """Metadata for a ragged batch of `num_tokens` tokens; computes the token positions and,
        given the pool's `pool_shape` (num_pages, page_size), the slots every layer writes the
        tokens' K/V to (once for all layers, instead of once per layer).

        Entries past `num_seqs` may hold anything: they are masked here, so that a padding row
        never moves a live token's position and the decode op sees it as an inactive slot
        (kv_len 0).
        """
        num_seq_slots = kv_lens.shape[0]
        if decode and num_tokens != num_seq_slots:
            raise ValueError(
                f"a decode step has one token per sequence slot: T={num_tokens} "
                f"!= S={num_seq_slots}"
            )
        n = jnp.clip(jnp.reshape(jnp.asarray(num_seqs, jnp.int32), (-1,))[0], 0, num_seq_slots)
        kv_lens = jnp.where(jnp.arange(num_seq_slots) < n, kv_lens, 0)
        cu_q_lens = jnp.where(jnp.arange(num_seq_slots + 1) <= n, cu_q_lens, cu_q_lens[n])
        _, pos, live = token_positions(cu_q_lens, kv_lens, num_tokens)
        slots = None
        if pool_shape is not None:
            num_pages, page_size = pool_shape
            slots = kv_slots(
                kv_lens,
                page_indices,
                cu_q_lens,
                n,
                num_tokens=num_tokens,
                num_pages=num_pages,
                page_size=page_size,
            )
            # Computed once: without the barrier XLA fuses the whole computation (a cummax,
            # a [T, S] comparison, page lookups) into every layer's K and V scatter, where
            # every element of the update recomputes its row's slot.
            slots = jax.lax.optimization_barrier(slots)
        if decode and prompt_only:
            raise ValueError(
                "decode=True and prompt_only=True: a decode step's tokens are decode tokens"
            )
        positions = jnp.where(live, pos, 0)
        return cls(
            kv_lens, page_indices, cu_q_lens, n, positions, slots, decode, prompt_only=prompt_only
        )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequencies rescaled for contexts longer than the model was trained on.

    kind: "linear" divides every frequency by `factor` (position interpolation); "llama3"
      (Llama 3.1 / 3.2) divides the low frequencies, of wavelength above
      `original_max_position / low_freq_factor`, by `factor`, keeps the high ones, of
      wavelength below `original_max_position / high_freq_factor`, and blends in between.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f'RopeScaling.kind must be "linear" or "llama3"; got {self.kind!r}')
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0; got {self.factor}")
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor and self.original_max_position > 0
        ):
            raise ValueError(
                "llama3 RopeScaling needs 0 < low_freq_factor < high_freq_factor and "
                f"original_max_position > 0; got {self}"
            )


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """f32[D/2] angular frequencies of the dimension pairs: `theta**(-2i/D)`, rescaled.

    Computed in float64 on the host and rounded once, so they are the same constants in every
    step and layer.
    """
    half = head_dim // 2
    freq = theta ** (-np.arange(half, dtype=np.float64) / half)
    if scaling is not None and scaling.kind == "linear":
        freq = freq / scaling.factor
    elif scaling is not None:
        wavelen = 2 * np.pi / freq
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * freq / scaling.factor + smooth * freq
        freq = np.where(
            wavelen > low_wavelen,
            freq / scaling.factor,
            np.where(wavelen < high_wavelen, freq, blended),
        )
    return freq.astype(np.float32)


def apply_rope(
    x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotary embedding, Llama/Qwen "rotate half" convention, computed in float32.

    x: [T, H, D] (D even); positions: i32[T]. Dimension pairs (i, i + D/2) rotate by
    `position * rope_frequencies(D, theta, scaling)[i]`. Returns x's shape and dtype.
    """
    inv_freq = rope_frequencies(x.shape[-1], theta, scaling)
    angles = positions.astype(jnp.float32)[:, None, None] * inv_freq  # [T, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis as flax's `nnx.RMSNorm` computes it (bit for bit): float32
    statistics, x times (rsqrt * scale), rounded to x's dtype."""
    x32 = x.astype(jnp.float32)
    mean_sq = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * (jax.lax.rsqrt(mean_sq + eps) * scale.astype(jnp.float32))).astype(x.dtype)


def add_rms_norm(
    x: jax.Array,
    h: jax.Array,
    scale: jax.Array,
    *,
    eps: float = 1e-6,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A residual add and the RMSNorm after it: `(s, rms_norm(s, scale, eps))` for
    `s = x + h` in x's dtype.

    Args:
      x: [T, hidden] the residual stream.
      h: [T, hidden] a layer's output in x's dtype; or float32 [S, T, hidden], partial sums
        of it over S parts of its projection's contraction (`split_k_dot`), which are summed
        and rounded to x's dtype first, as the projection's own output would be (a decode
        step leaves the o and down projections' split-K sums to this op instead of kernels
        of their own).
      scale: [hidden] the norm's scale.
      implementation: "xla" the reference, "triton" one Pallas kernel (Triton lowering;
        interpret mode off-GPU), None that kernel on a GPU, "mosaic" one Mosaic GPU kernel
        on Hopper (`pallas_kernels.mosaic.add_rms_norm`, hidden a multiple of 4; the Triton
        kernel's rules otherwise, the reference off-GPU).
    """
    partial = h.ndim == 3
    if x.ndim != 2 or h.shape[partial:] != x.shape or (h.dtype != x.dtype and not partial):
        raise ValueError(
            f"x and h must be [T, hidden] of one shape and dtype (or h float32 partial sums "
            f"[S, T, hidden]); got {x.dtype}{list(x.shape)}, {h.dtype}{list(h.shape)}"
        )
    if partial and h.dtype != jnp.float32:
        raise ValueError(f"partial sums h [S, T, hidden] must be float32; got {h.dtype}")
    if scale.shape != x.shape[1:]:
        raise ValueError(f"scale must be [hidden={x.shape[1]}]; got {scale.shape}")
    kernel = _add_rms_norm_kernel(implementation, x.shape[1])
    if kernel is not None:
        with quiet_triton_deprecation():
            return kernel(x, h, scale, eps=eps)
    if partial:
        h = h.sum(0).astype(x.dtype)
    total = x + h
    return total, rms_norm(total, scale, eps)


# Decode steps of at most this many tokens compute the qkv and gate/up projections as float32
# partial sums over `DECODE_SPLIT_K` parts of the hidden dimension (`split_k_dot`), which the
# op after each sums as it reads them (`rope_append`; SwiGLU's XLA fusion). XLA split qkv's K
# itself but summed the parts in a kernel of its own (1.2-1.4 us a layer); it did not split
# gate/up, whose 192 (B=1) or 96 (B=16) output tiles left the SMs unevenly loaded: 14.8 ->
# 13.7 us a layer at B=1, 15.7 -> 14.4 at B=16 (benchmarks/NOTES.md, session 30, run 158).
DECODE_SPLIT_K = 4
DECODE_SPLIT_K_MAX_TOKENS = 16
# Likewise the o and down projections (the layer's outputs), whose partial sums `add_rms_norm`
# sums with the residual add. XLA split their K itself and summed the parts in a kernel of its
# own (1.2-1.5 us each); as 8 parts summed in the norm (16 warps a row), o + down + their
# sums + the two norms went 18.4 -> 16.5 us a layer at B=1 and 20.0 -> 17.3 at B=16 (runs
# 161-162). With 4 parts the batched down GEMM is slower (9.2 us against 7.7 + 1.2).
DECODE_OUTPUT_SPLIT_K = 8
DECODE_OUTPUT_SPLIT_K_MAX_TOKENS = 16


def split_k_dot(x: jax.Array, w: jax.Array, splits: int, precision=None) -> jax.Array:
    """x [T, K] @ w [K, N] as float32 partial sums [S, T, N] over `splits` equal parts of K,
    one batched dot; `sum(0)` is the product."""
    num_tokens, k = x.shape
    if w.shape[0] != k or k % splits:
        raise ValueError(
            f"split_k_dot needs w [K={k}, N] and K a multiple of splits={splits}; got {w.shape}"
        )
    return jnp.einsum(
        "tsk,skn->stn",
        x.reshape(num_tokens, splits, k // splits),
        w.reshape(splits, k // splits, w.shape[1]),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def split_k_linear(proj: nnx.Linear, x: jax.Array, splits: int = 1) -> jax.Array:
    """`proj(x)` for x [T, K]; with `splits` > 1 its float32 partial sums [S, T, N] instead
    (`split_k_dot`; for a projection without a bias)."""
    if splits == 1:
        return proj(x)
    return split_k_dot(x.astype(proj.dtype), proj.kernel[...], splits, proj.precision)


def decode_split_k(x: jax.Array, *, output: bool = False) -> int:
    """The K-splits of a step's projection of x [T, K]: qkv and gate/up (`DECODE_SPLIT_K`), or
    with `output` o and down (`DECODE_OUTPUT_SPLIT_K`); 1: unsplit."""
    num_tokens, k = x.shape
    splits, max_tokens = (
        (DECODE_OUTPUT_SPLIT_K, DECODE_OUTPUT_SPLIT_K_MAX_TOKENS)
        if output
        else (DECODE_SPLIT_K, DECODE_SPLIT_K_MAX_TOKENS)
    )
    return splits if num_tokens <= max_tokens and splits > 1 and k % splits == 0 else 1


def _use_kernel(implementation: str | None) -> bool:
    """Whether `rope_append` and `add_rms_norm` run their Pallas kernel (Triton lowering):
    "triton" anywhere (interpret mode off-GPU), None or "mosaic" on a GPU; "xla" never."""
    if implementation not in (None, "xla", "triton", "mosaic"):
        raise ValueError(f"unknown implementation {implementation!r}")
    on_gpu = jax.default_backend() == "gpu"
    return implementation == "triton" or (implementation != "xla" and on_gpu)


def _rope_append_kernel(implementation: str | None, head_dim: int):
    """The kernel `rope_append` runs, or None for the reference: the Mosaic GPU one for
    "mosaic" on a GPU, else the Triton one where `_use_kernel` says (interpret mode off-GPU),
    each where it takes `head_dim`."""
    on_gpu = jax.default_backend() == "gpu"
    if implementation == "mosaic" and on_gpu:
        from pallas_kernels.mosaic import rope_append as mosaic  # noqa: PLC0415

        if mosaic.supported(head_dim):
            return mosaic.rope_append
    if _use_kernel(implementation):
        from pallas_kernels.triton import rope_append as fused  # noqa: PLC0415

        if fused.supported(head_dim):
            return functools.partial(fused.rope_append, interpret=not on_gpu)
    return None


def _add_rms_norm_kernel(implementation: str | None, hidden: int):
    """The kernel `add_rms_norm` runs, or None for the reference: the Mosaic GPU one for
    "mosaic" on Hopper where it takes `hidden`, else the Triton one where `_use_kernel` says
    (interpret mode off-GPU). None keeps the Triton kernel: the Mosaic one took 2.19 / 2.28 us
    a call in the `1b` decode step at B=1 / 16 against its 2.11 (benchmarks/NOTES.md, run
    189)."""
    if implementation == "mosaic" and _on_hopper():
        from pallas_kernels.mosaic import add_rms_norm as mosaic  # noqa: PLC0415

        if mosaic.supported(hidden):
            return mosaic.add_rms_norm
    if _use_kernel(implementation):
        from pallas_kernels.triton import add_rms_norm as fused  # noqa: PLC0415

        return functools.partial(fused.add_rms_norm, interpret=jax.default_backend() != "gpu")
    return None


def _on_hopper() -> bool:
    """Whether the default device is an sm90 GPU, where the Mosaic GPU kernels run."""
    return dispatch.default_device().compute_capability == "9.0"


def rope_append(
    qkv: jax.Array,
    positions: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    slots: jax.Array,
    *,
    theta: float,
    scaling: RopeScaling | None = None,
    q_scale: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    eps: float = 1e-6,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What an attention layer does between its QKV projection and attention: the optional
    qk-norm, RoPE of q and k, and the write of the new K/V into the pages.

    Args:
      qkv: [T, Hkv, G + 2, D] the projection in `fuse_qkv`'s order: per KV head its G query
        heads, its k, its v; or float32 [S, T, Hkv, G + 2, D], partial sums of it over S parts
        of the contraction (`split_k_dot`), which are summed and rounded to the pages' dtype
        first, as the projection's own output would be (a decode step leaves its split-K sum
        to this op instead of a kernel of its own).
      positions: i32[T] the tokens' positions.
      k_pages, v_pages: [P, page_size, Hkv, D] one layer's pages (updated; donate them).
      slots: i32[T] each token's pool slot (`jaxpaged.kv_slots`); -1, or a slot outside the
        pool, writes nothing.
      theta, scaling: RoPE's, as `apply_rope`.
      q_scale, k_scale: f32 or the dtype's [D] RMSNorm scales of q and k (both or neither).
      eps: RMSNorm's epsilon.
      implementation: "xla" (the reference: `rms_norm`, `apply_rope`, `write_kv`), "triton"
        (one Pallas kernel, Triton lowering; interpret mode off-GPU), None (that kernel on a
        GPU) or "mosaic" (one Mosaic GPU kernel on a GPU, `pallas_kernels.mosaic.
        rope_append`, for D of 64, 128 or 256; the Triton kernel's rules otherwise;
        the reference off-GPU). The Triton kernel takes D / 2 a power of two >= 16; both take
        qkv in the pages' dtype or float32 partial sums; other calls run the reference.

    Returns:
      `(q [T, Hkv * G, D], k_pages, v_pages)`, q in the pages' dtype.
    """
    partial = qkv.ndim == 5
    num_tokens, num_kv_heads, group2, head_dim = qkv.shape[-4:] if qkv.ndim in (4, 5) else (0,) * 4
    if qkv.ndim not in (4, 5) or group2 < 3 or k_pages.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"qkv must be [T, Hkv, G + 2, D] (or float32 partial sums [S, T, Hkv, G + 2, D]) "
            f"with the pages' Hkv and D {k_pages.shape[2:]}; got {qkv.shape}"
        )
    if partial and qkv.dtype != jnp.float32:
        raise ValueError(f"partial sums qkv [S, T, Hkv, G + 2, D] must be float32; got {qkv.dtype}")
    if positions.shape != (num_tokens,) or slots.shape != (num_tokens,):
        raise ValueError(
            f"positions and slots must be i32[T={num_tokens}]; got {positions.shape}, {slots.shape}"
        )
    if (q_scale is None) != (k_scale is None):
        raise ValueError("q_scale and k_scale go together: pass both or neither")
    if q_scale is not None and (q_scale.shape, k_scale.shape) != ((head_dim,),) * 2:
        raise ValueError(
            f"q_scale and k_scale must be [D={head_dim}]; got {q_scale.shape}, {k_scale.shape}"
        )
    group = group2 - 2
    kernel = (
        _rope_append_kernel(implementation, head_dim)
        if (k_pages.dtype == v_pages.dtype and (partial or qkv.dtype == k_pages.dtype))
        else None
    )
    if kernel is not None:
        with quiet_triton_deprecation():
            return kernel(
                qkv,
                *_rope_angles(positions, head_dim, theta, scaling),
                q_scale,
                k_scale,
                k_pages,
                v_pages,
                slots.astype(jnp.int32),
                eps=eps,
            )
    if partial:
        qkv = qkv.sum(0).astype(k_pages.dtype)
    q = qkv[:, :, :group].reshape(num_tokens, num_kv_heads * group, head_dim)
    k, v = qkv[:, :, group], qkv[:, :, group + 1]
    if q_scale is not None:
        q, k = rms_norm(q, q_scale, eps), rms_norm(k, k_scale, eps)
    q = apply_rope(q, positions, theta, scaling).astype(k_pages.dtype)
    k = apply_rope(k, positions, theta, scaling).astype(k_pages.dtype)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v.astype(v_pages.dtype), slots)
    return q, k_pages, v_pages


def _rope_angles(positions, head_dim, theta, scaling) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[T, D / 2] of RoPE's angles at `positions` i32[T], as the kernels take
    them."""
    angles = positions.astype(jnp.float32)[:, None] * rope_frequencies(head_dim, theta, scaling)
    return jnp.cos(angles), jnp.sin(angles)


def folds_rope(qkv, k_pages, v_pages, meta, implementation) -> bool:
    """Whether a step's `rope_append` and attention run as one Mosaic GPU kernel
    (`pallas_kernels.mosaic.paged_decode.rope_append_decode_attention`): a decode step without
    shared prefixes whose attention runs the Mosaic GPU decode kernel (`implementation`
    "mosaic", or None where `jaxpaged.dispatch` picks it), in a grid of items
    (`folds_rope`), with qkv as float32 partial sums or in the pages' dtype."""
    if not meta.decode or meta.prefix_groups is not None or k_pages.dtype != v_pages.dtype:
        return False
    if jax.default_backend() != "gpu" or not (qkv.ndim == 5 or qkv.dtype == k_pages.dtype):
        return False
    num_seqs, num_kv_heads, _, head_dim = qkv.shape[-4:]
    if num_seqs != meta.kv_lens.shape[0]:  # not one token a sequence: attention raises
        return False
    name = resolve_implementation(
        "decode",
        implementation,
        k_pages.dtype,
        head_dim=head_dim,
        page_size=k_pages.shape[1],
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        max_kv_len=meta.page_indices.shape[1] * k_pages.shape[1],
    )
    if name != "mosaic":
        return False
    from pallas_kernels.mosaic import paged_decode as mosaic  # noqa: PLC0415

    return mosaic.folds_rope(num_seqs, num_kv_heads, head_dim)


TP_AXIS = "tp"  # the mesh axis tensor parallelism splits heads over


def tensor_parallel_size() -> int:
    """The size of the `"tp"` axis of the mesh set by `jax.set_mesh` (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or TP_AXIS not in mesh.axis_names else mesh.shape[TP_AXIS]


def fuse_qkv(wq, wk, wv, num_kv_heads: int) -> jax.Array:
    """q, k and v projections `[..., Hq*D]`, `[..., Hkv*D]`, `[..., Hkv*D]` (kernels or biases,
    heads along the last axis) -> one `[..., Hkv*(G+2)*D]` in KV-group-major order: for each KV
    head, its G = Hq/Hkv query heads, then its k, then its v. Any split of the last axis into
    equal contiguous parts (tensor parallelism) then holds whole GQA groups."""
    *lead, cols = wk.shape
    head_dim = cols // num_kv_heads
    groups = [w.reshape(*lead, num_kv_heads, -1, head_dim) for w in (wq, wk, wv)]
    return jnp.concatenate(groups, axis=-2).reshape(*lead, -1)


def split_qkv(w, num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple[jax.Array, ...]:
    """The inverse of `fuse_qkv`: `[..., Hkv*(G+2)*D]` -> q `[..., Hq*D]`, k and v
    `[..., Hkv*D]`."""
    group = num_q_heads // num_kv_heads
    *lead, _ = w.shape
    w = w.reshape(*lead, num_kv_heads, group + 2, head_dim)
    q, k, v = w[..., :group, :], w[..., group, :], w[..., group + 1, :]
    return q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)


class PagedAttention(nnx.Module):
    """Grouped-query self-attention of a ragged batch over one layer's KV pages.

    Llama / Qwen2 / Qwen3 / Mistral style: q/k/v/o projections (biases optional: Qwen2 has them
    on q, k and v), optional RMSNorm of q and k over D per head (Qwen3's qk-norm), RoPE at each
    token's position (optionally rescaled, `RopeScaling`), causal attention over the sequence's
    cached tokens and its new ones, optionally within a sliding window of `sliding_window` keys
    (Mistral). `dtype` is that of the parameters, the computation and the pages; `precision`
    that of the projections (float32 on GPUs defaults to TF32 matmuls: pass "highest" for IEEE
    float32, as the kernels' float32 dots are).
    """

    def __init__(
        self,
        hidden_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 10_000.0,
        rope_scaling: RopeScaling | None = None,
        qk_norm: bool = False,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window: int | None = None,
        norm_eps: float = 1e-6,
        dtype: jnp.dtype = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        rngs: nnx.Rngs,
    ):
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim; got {head_dim}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.eps = norm_eps
        self.sliding_window = sliding_window
        linear = functools.partial(
            nnx.Linear, dtype=dtype, param_dtype=dtype, precision=precision, rngs=rngs
        )
        # One [hidden, (Hq + 2 Hkv) D] matrix for q, k and v in KV-group-major order (`fuse_qkv`):
        # one matmul that reads x once, and a column split over devices keeps GQA groups whole.
        self.qkv_proj = linear(
            hidden_size, (num_q_heads + 2 * num_kv_heads) * head_dim, use_bias=qkv_bias
        )
        self.o_proj = linear(num_q_heads * head_dim, hidden_size, use_bias=o_bias)
        norm = functools.partial(
            nnx.RMSNorm, head_dim, epsilon=norm_eps, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.q_norm = norm() if qk_norm else None
        self.k_norm = norm() if qk_norm else None

    def __call__(
        self,
        x: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        meta: StepMetadata,
        *,
        implementation: str | None = None,
        partial_sums: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attend the step's tokens and append their K/V.

        Args:
          x: [T, hidden] the step's tokens, packed like `ragged_paged_attention`'s `q`.
          k_pages, v_pages: [P, page_size, Hkv, D] this layer's pages (donated by `append_kv`
            when called outside `jit`; use the returned ones).
          meta: the step's `StepMetadata`.
          implementation: attention backend, as `ragged_paged_attention` (None: best here).
          partial_sums: for a small step (`decode_split_k(..., output=True)`) without tensor
            parallelism or an o bias, return the output projection as float32 partial sums
            [S, T, hidden] (`split_k_dot`), for `add_rms_norm` to sum.

        Returns:
          `(out [T, hidden], k_pages, v_pages)`; padding tokens give arbitrary finite rows.
        """
        num_tokens = x.shape[0]
        attend = functools.partial(
            _attend, sliding_window=self.sliding_window, implementation=implementation
        )
        tp = tensor_parallel_size()
        if tp == 1 and meta.kv_slots is not None:
            qkv = self._qkv(x, partial=True)
            out, k_pages, v_pages = self._rope_attend(
                qkv, k_pages, v_pages, meta, implementation, merge=True
            )
            out = out.reshape(num_tokens, -1).astype(x.dtype)
            split = partial_sums and self.o_proj.bias is None
            splits = decode_split_k(out, output=True) if split else 1
            return split_k_linear(self.o_proj, out, splits), k_pages, v_pages
        q, k, v = self.project(x, meta.positions)
        q, k, v = q.astype(k_pages.dtype), k.astype(k_pages.dtype), v.astype(v_pages.dtype)
        if tp > 1:
            if self.num_kv_heads % tp:
                raise ValueError(
                    f"num_kv_heads {self.num_kv_heads} must be a multiple of the {TP_AXIS!r} "
                    f"mesh axis ({tp} devices): GQA groups are not split across devices"
                )
            # Each device appends and attends its own KV heads and their query heads.
            heads, pages = P(None, TP_AXIS, None), P(None, None, TP_AXIS, None)
            attend = jax.shard_map(
                attend,
                in_specs=(heads, heads, heads, pages, pages, P()),
                out_specs=(heads, pages, pages),
                check_vma=False,
            )
        out, k_pages, v_pages = attend(q, k, v, k_pages, v_pages, meta)
        out = self.o_proj(out.reshape(num_tokens, -1).astype(x.dtype))
        return out, k_pages, v_pages

    def attend_states(
        self,
        qkv: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        meta: StepMetadata,
        *,
        implementation: str | None = None,
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array, jax.Array]:
        """A decode step's attention from its qkv projection, left as split-KV states for a
        caller that merges them (`models.decoder.post_attention`); without tensor
        parallelism or shared prefixes, with `meta.kv_slots`.

        Args:
          qkv: `_qkv(x, partial=True)`: [T, Hkv, G + 2, D], or float32 partial sums of it.
          k_pages, v_pages, meta, implementation: as `__call__`'s (a decode step).

        Returns:
          `((out [S, splits, Hq, D], lse f32[S, splits, Hq]), k_pages, v_pages)`: the
          Mosaic GPU decode kernel's unmerged states where it folds `rope_append`
          (`folds_rope`), else one split (the merged output and its LSE).
        """
        if not meta.decode or meta.kv_slots is None or meta.prefix_groups is not None:
            raise ValueError(
                "attend_states takes a decode step's metadata with its kv_slots and no prefix "
                "groups"
            )
        return self._rope_attend(qkv, k_pages, v_pages, meta, implementation, merge=False)

    def _rope_attend(self, qkv, k_pages, v_pages, meta, implementation, *, merge):
        """`rope_append` and attention from the qkv projection, one Mosaic GPU kernel where
        `folds_rope`: `(out [T, Hq, D], k_pages, v_pages)`; without `merge` (a decode step)
        `((out [S, splits, Hq, D], lse [S, splits, Hq]), k_pages, v_pages)`."""
        q_scale = None if self.q_norm is None else self.q_norm.scale[...]
        k_scale = None if self.k_norm is None else self.k_norm.scale[...]
        if folds_rope(qkv, k_pages, v_pages, meta, implementation):
            from pallas_kernels.mosaic import paged_decode as mosaic  # noqa: PLC0415

            angles = _rope_angles(meta.positions, self.head_dim, self.rope_theta, self.rope_scaling)
            out, lse, k_pages, v_pages = mosaic.rope_append_decode_attention(
                qkv,
                *angles,
                q_scale,
                k_scale,
                k_pages,
                v_pages,
                meta.kv_slots,
                meta.kv_lens,
                meta.page_indices,
                eps=self.eps,
                sm_scale=self.head_dim**-0.5,
                sliding_window=self.sliding_window,
                merge=merge,
            )
            return (out if merge else (out, lse)), k_pages, v_pages
        q, k_pages, v_pages = rope_append(
            qkv,
            meta.positions,
            k_pages,
            v_pages,
            meta.kv_slots,
            theta=self.rope_theta,
            scaling=self.rope_scaling,
            q_scale=q_scale,
            k_scale=k_scale,
            eps=self.eps,
            implementation=implementation,
        )
        attend = functools.partial(
            _attend, sliding_window=self.sliding_window, implementation=implementation
        )
        if merge:
            return attend(q, None, None, k_pages, v_pages, meta)
        out, lse = paged_decode_attention(
            q,
            k_pages,
            v_pages,
            meta.kv_lens,
            meta.page_indices,
            sliding_window=self.sliding_window,
            implementation=implementation,
            return_lse=True,
        )
        return (out[:, None], lse[:, None]), k_pages, v_pages

    def _qkv(self, x: jax.Array, partial: bool = False) -> jax.Array:
        """x [T, hidden] -> the projection [T, Hkv, G + 2, D] (`fuse_qkv`'s order); with
        `partial`, for a decode step (`decode_split_k`) float32 partial sums [S, T, ...] of it
        that `rope_append` sums."""
        group = self.num_q_heads // self.num_kv_heads
        shape = (x.shape[0], self.num_kv_heads, group + 2, self.head_dim)
        splits = decode_split_k(x) if partial and self.qkv_proj.bias is None else 1
        product = split_k_linear(self.qkv_proj, x, splits)
        return product.reshape(splits, *shape) if splits > 1 else product.reshape(shape)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """x [T, hidden] at positions i32[T] -> rotated q [T, Hq, D], rotated k and v
        [T, Hkv, D], in the layer's dtype."""
        group = self.num_q_heads // self.num_kv_heads
        qkv = self._qkv(x)
        q = qkv[:, :, :group].reshape(x.shape[0], self.num_q_heads, self.head_dim)
        k, v = qkv[:, :, group], qkv[:, :, group + 1]
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm.scale[...], self.eps)
            k = rms_norm(k, self.k_norm.scale[...], self.eps)
        q = apply_rope(q, positions, self.rope_theta, self.rope_scaling)
        k = apply_rope(k, positions, self.rope_theta, self.rope_scaling)
        return q, k, v


def _attend(q, k, v, k_pages, v_pages, meta, *, sliding_window, implementation):
    """Append one layer's new K/V to its pages (k and v None: already appended) and attend:
    (out [T, Hq, D], k_pages, v_pages). Under tensor parallelism it runs on each device's
    heads (`shard_map`)."""
    if k is None:
        pass  # appended by `rope_append`
    elif meta.kv_slots is not None:
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, meta.kv_slots)
    else:
        k_pages, v_pages = append_kv(
            k_pages,
            v_pages,
            k,
            v,
            meta.kv_lens,
            meta.page_indices,
            meta.cu_q_lens,
            meta.num_seqs,
        )
    if meta.decode and meta.prefix_groups is not None and sliding_window is None:
        out = shared_prefix_decode_attention(
            q,
            k_pages,
            v_pages,
            meta.kv_lens,
            meta.page_indices,
            meta.prefix_groups,
            implementation=implementation,
        )
    elif meta.decode:
        out = paged_decode_attention(
            q,
            k_pages,
            v_pages,
            meta.kv_lens,
            meta.page_indices,
            sliding_window=sliding_window,
            implementation=implementation,
        )
    else:
        out = ragged_paged_attention(
            q,
            k_pages,
            v_pages,
            meta.kv_lens,
            meta.page_indices,
            meta.cu_q_lens,
            meta.num_seqs,
            sliding_window=sliding_window,
            implementation=implementation,
            short_sequences=not meta.prompt_only,
        )
    return out, k_pages, v_pages
