"""Split-KV paged decode attention for Hopper (sm_90), lowered through Mosaic GPU: its config,
split rule, checks and launch. The kernel body is `decode_body`, the slot order `slot_order`,
the K/V page pipeline (shared with the prefill kernel) `pipeline`.

The work comes in items, one per (KV head, split, sequence slot). The kernel needs 175-245
registers per thread, so one program runs per SM; by default (`MosaicDecodeConfig.persistent`)
a call of more items than SMs has one program per SM and each walks its items of a snake
order, longest sequences first, so that an SM fills its K/V pipeline once rather than once per
item; a call of fewer runs one program an item.

Split `i` covers the fixed pipeline steps `[i * chunk, (i + 1) * chunk)` of the visible range
(a split past a short sequence's end loops zero times), so that in a ragged batch no item is
longer than one chunk. With one split the kernel's outputs are final (page-table and length
clamps happen in the kernel); with more, the f32 partials are merged by a second Mosaic GPU
kernel (`pallas_kernels.mosaic.merge`), or in XLA (`pallas_kernels.common.merge_splits`) for
more splits than it takes. Keys past `kv_len` or before a sliding window never
reach the output (`pipeline`).

`rope_append_decode_attention` is the same kernel taking a decode step's QKV projection
instead of q: it does the layer's `rope_append` too (`decode_body.RopeFold`), one kernel fewer
a layer, for calls of a grid of items (`folds_rope`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (
    H200_NUM_SMS,
    device_num_sms,
    merge_splits,
)
from pallas_kernels.mosaic import decode_body, slot_order
from pallas_kernels.mosaic import merge as mosaic_merge
from pallas_kernels.mosaic import rope_append as rope_rows
from pallas_kernels.mosaic.common import (
    check_inputs,
    check_pipeline,
    check_smem,
    default_block_kv,
    launch,
    takes,
)

# Shared memory the default configs give the K/V stages: enough bytes in flight per SM for HBM
# latency at 1/132 of the H200's bandwidth, and one program per SM.
_DEFAULT_STAGE_BYTES = 128 * 1024
# What the default config becomes in a call of persistent programs at D=128 (more items than
# SMs): 64-key steps, four stages, two compute warpgroups on alternate steps (the 245 registers
# a thread of 128-key steps need do not fit three warpgroups; 175 do). Run 111, the `1b`
# attention shape: B=64 74.3 against 76.8 us a call, and 122 us with two warpgroups of 128-key
# steps (spills).
_PERSISTENT_D128 = dict(block_kv=64, num_stages=4, compute_warpgroups=2)
# A split does at least this many pipeline steps (when the sequence has them). One: with SMs
# left idle, a short sequence split to one step per program finishes sooner than with fewer,
# longer splits, though each pays the pipeline fill (benchmarks/NOTES.md).
_MIN_STEPS_PER_SPLIT = 1


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Tuning knobs of the Mosaic GPU decode kernel.

    Attributes:
      block_kv: KV tokens per pipeline step, the N of the Q K^T `wgmma`: a multiple of 64 and
        of `page_size`, at most 256. Each step copies `block_kv // page_size` pages of K and
        of V, one TMA copy per page.
      num_stages: pipeline steps of K and V buffered in shared memory, i.e. how far the copy
        warpgroup runs ahead of compute. Shared memory per stage is `2 * block_kv * D * 2`
        bytes. One program runs per SM whatever its shared memory: the kernel needs more
        registers per thread (ptxas) than two programs of 256 threads can have.
      longest_first: take the sequences in order of decreasing kv_len (splits of a
        sequence in order, all first splits before any second one), so that in a ragged
        batch no SM is left with a long item at the end. Up to `slot_order.MAX_SLOTS_RANKED`
        slots each program ranks them in shared memory as it starts; more take one XLA sort
        of `kv_lens` per call (`slot_order.choose`). Calls of at most one item an SM skip
        the order: their programs all start at once (B=1 at the `1b` shape: 4.54 -> 4.43 us
        a call, run 151).
      persistent: launch one program per SM, each walking its items (KV head, split, slot)
        of a snake order (`decode_body.snake_item`) with one K/V pipeline: the next item's
        pages stream in while the last one finishes, so an SM pays the pipeline fill once,
        not once per item. With `longest_first` the snake deals long and short items alike
        to every SM. The default (with `longest_first`): faster on ragged batches, as fast on
        uniform ones (benchmarks/NOTES.md). A call of no more items than SMs runs the grid of
        items instead (one program an item either way; the grid skips the walk's costs).
      compute_warpgroups: 1, or 2 to give the pipeline steps of alternate parity to two
        compute warpgroups (one's softmax overlaps the other's `wgmma`; `num_stages` even).
        Three warpgroups leave a compute thread 232 registers: enough for 64-key steps (175),
        not for 128-key ones (245; they spill and run 1.6x slower, run 111). `config=None`
        gives persistent calls at D=128 64-key steps in two warpgroups (`_PERSISTENT_D128`).
    """

    block_kv: int = 128
    num_stages: int = 2
    longest_first: bool = True
    persistent: bool = True
    compute_warpgroups: int = 1

    def __post_init__(self):
        check_pipeline(self.block_kv, self.num_stages)
        if self.compute_warpgroups not in (1, 2):
            raise ValueError(f"compute_warpgroups must be 1 or 2; got {self.compute_warpgroups!r}")
        if self.compute_warpgroups == 2 and self.num_stages % 2:
            raise ValueError(
                "compute_warpgroups=2 needs an even num_stages (each compute warpgroup takes "
                f"the pipeline steps of one parity); got num_stages={self.num_stages}"
            )

    @classmethod
    def default(cls, head_dim: int) -> MosaicDecodeConfig:
        """The config used when `config=None`: steps of 128 tokens (64 at D=256) and as many
        stages as 128 KiB of K/V hold (4 at D=64, 2 at D=128 and 256), the best measured at
        D=128. Persistent programs with the longest sequences first, except at D=256, where
        the 64 KiB of float32 output staging leave a persistent program too little room
        beside two stages."""
        block_kv = default_block_kv(head_dim)
        stage_bytes = 2 * block_kv * head_dim * 2
        return cls(
            block_kv=block_kv,
            num_stages=_DEFAULT_STAGE_BYTES // stage_bytes,
            persistent=head_dim <= 128,
        )


def supports(head_dim: int, page_size: int, group: int) -> bool:
    """Whether the kernel with its default config takes bf16/f16 inputs of head dim
    `head_dim`, pages of `page_size` and `group` query heads per KV head (the checks of
    `paged_decode_attention`, without raising)."""
    block_kv = MosaicDecodeConfig.default(head_dim).block_kv
    return (
        takes(head_dim, page_size, block_kv)
        and decode_body.q_copy_rows(group) <= decode_body.TILE_M
    )


def choose_num_splits(
    num_seq_slots: int,
    num_kv_heads: int,
    max_steps: int,
    num_sms: int = H200_NUM_SMS,
) -> int:
    """KV splits per sequence, from shapes only (static, so one compilation per batch shape).

    `max_steps` is the most pipeline steps a sequence can need (see `_max_steps`). Programs
    need more registers than two can share, so one runs per SM: take the most splits that keep
    the grid within one wave (`num_sms` programs), so that each program's fixed costs (Q copy,
    pipeline fill, output write) are paid once per SM; but never make a split shorter than
    `_MIN_STEPS_PER_SPLIT` steps. (The Triton decode kernel's rule, a rounded-up target of 8
    small programs per SM, would give these a second, partial wave.)

    >>> choose_num_splits(1, 8, 256)  # B=1, ctx 32768, block_kv 128: 128 programs
    16
    """
    programs = num_seq_slots * num_kv_heads
    by_length = max(1, max_steps // _MIN_STEPS_PER_SPLIT)
    return max(1, min(num_sms // programs, by_length))


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    num_splits: int | None = None,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    config: MosaicDecodeConfig | None = None,
    interpret: bool = False,
    profile_dir: str | None = None,
    merge: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Split-KV decode over paged KV with TMA page copies and `wgmma` (Hopper only).

    Args:
      q: [S, Hq, D] bfloat16/float16, the token at position `kv_len - 1` of every slot.
      k_pages, v_pages: [P, page_size, Hkv, D], q's dtype. D a multiple of 64 up to 256;
        `page_size` a multiple of 8 that divides `config.block_kv`; Hq // Hkv <= 64.
      kv_lens: i32[S]; 0 marks an inactive slot.
      page_indices: i32[S, pages_per_seq].
      num_splits: KV splits per sequence; None: `choose_num_splits`.
      sm_scale, sliding_window, logits_soft_cap: as `jaxpaged.paged_decode_attention`.
      config: `MosaicDecodeConfig`; None: `MosaicDecodeConfig.default(D)`, which a call of
        persistent programs at D=128 (and pages that divide 64 keys) runs as 64-key steps, four
        stages and two compute warpgroups (`_PERSISTENT_D128`).
      interpret: must be False: Mosaic GPU's interpreter (jax 0.11.2) runs neither this
        kernel's `pl.run_state` accumulators nor its per-thread `inline_mgpu` code.
      profile_dir: diagnostics only: every call writes a trace of each program's named
        regions (Mosaic GPU's in-kernel profiler) as JSON into this directory.
      merge: False returns the splits' states unmerged, `out` [S, splits, Hq, D] (float32, or
        q's dtype for one split) and `lse` f32[S, splits, Hq], for a caller that merges them
        with states of its own in one pass (`jaxpaged.shared_prefix`).

    Returns:
      `out` [S, Hq, D] in q's dtype and `lse` f32[S, Hq] (natural log); inactive slots give 0
      and -inf. Invalid metadata inside `jit` may give wrong numbers but no out-of-bounds
      access (it is clamped as by `pallas_kernels.common.sanitize_metadata`).
    """
    if interpret:
        check_inputs("decode", q.dtype, q.shape[-1], k_pages.shape[1], MosaicDecodeConfig(), True)
    q_shape = q.shape
    q_rows = decode_body.q_copy_rows(q.shape[1] // k_pages.shape[2])
    if q.shape[1] < q_rows:
        # The Q copy is a box of q_rows heads; smaller q gets padded so the box fits. Larger q
        # needs no copy: TMA reads rows past the end as zeros.
        q = jnp.pad(q, ((0, 0), (0, q_rows - q.shape[1]), (0, 0)))
    return _decode(
        (q,),
        q_shape,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        num_splits=num_splits,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        config=config,
        profile_dir=profile_dir,
        merge=merge,
    )


def folds_rope(num_seq_slots: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `rope_append_decode_attention` takes a batch of this shape with its default
    config and split rule: D of 64, 128 or 256 (`rope_append.supported`) and at most one
    (sequence, KV head) pair per SM, so that the call runs a grid of items in one compute
    warpgroup (not persistent programs)."""
    return rope_rows.supported(head_dim) and num_seq_slots * num_kv_heads <= device_num_sms()


def rope_append_decode_attention(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    q_scale: jax.Array | None,
    k_scale: jax.Array | None,
    k_pages: jax.Array,
    v_pages: jax.Array,
    slots: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    eps: float,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    profile_dir: str | None = None,
    merge: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A decode step's `rope_append` and `paged_decode_attention` in one kernel, one kernel
    launch fewer a layer: each program builds its Q tile from the projection, and the split
    that holds the new key writes it into the pages and into its last K and V stages.

    Args:
      qkv, cos, sin, q_scale, k_scale, slots, eps: as `pallas_kernels.mosaic.rope_append.
        rope_append`, one token per sequence slot (T = S): qkv [S, Hkv, G + 2, D] in the pages'
        dtype or float32 partial sums [parts, S, Hkv, G + 2, D].
      k_pages, v_pages, kv_lens, page_indices, sm_scale, sliding_window, logits_soft_cap: as
        `paged_decode_attention`; `kv_lens` counts the new token, written at slot `slots[s]`
        (`page_indices` must name it at position `kv_len - 1`, as `jaxpaged.kv_slots` does).
        Shapes where `folds_rope` is True only.
      profile_dir: as `paged_decode_attention`'s (diagnostics).
      merge: False returns the splits' states unmerged, as `paged_decode_attention`'s
        (`pallas_kernels.mosaic.layer` merges them in its first phase).

    Returns:
      `(out [S, Hq, D], lse f32[S, Hq], k_pages, v_pages)`, out in the pages' dtype; without
      `merge` out [S, splits, Hq, D] (float32, or the pages' dtype for one split) and lse
      f32[S, splits, Hq].
    """
    partial = qkv.ndim == 5
    num_seq_slots, num_kv_heads, group2, head_dim = qkv.shape[-4:]
    _check_rope(qkv, cos, sin, q_scale, k_scale, k_pages, v_pages, slots, kv_lens, page_indices)
    if not folds_rope(num_seq_slots, num_kv_heads, head_dim):
        raise ValueError(
            f"rope_append_decode_attention takes D of 64, 128 or 256 and at most one (sequence, "
            f"KV head) pair per SM; got D={head_dim}, {num_seq_slots} x {num_kv_heads} pairs"
        )
    rope = decode_body.RopeFold(eps=eps, qk_norm=q_scale is not None)
    scales = () if q_scale is None else (q_scale, k_scale)
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)
    out, lse = _decode(
        (qkv if partial else qkv[None], cos, sin, *scales, slots),
        (num_seq_slots, num_kv_heads * (group2 - 2), head_dim),
        k_ref,
        v_ref,
        kv_lens,
        page_indices,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        profile_dir=profile_dir,
        dtype=k_pages.dtype,
        rope=rope,
        merge=merge,
    )
    return out, lse, k_ref[...], v_ref[...]


def _decode(
    front,
    q_shape,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    *,
    num_splits=None,
    sm_scale,
    sliding_window,
    logits_soft_cap,
    config=None,
    profile_dir=None,
    merge=True,
    dtype=None,
    rope=None,
):
    """The launch of either entry point: `front` the inputs before the pages (q, or with
    `rope` the inputs of `decode_body.RopeFold`), `q_shape` (S, Hq, D) of the queries."""
    num_seq_slots, num_q_heads, head_dim = q_shape
    dtype = front[0].dtype if dtype is None else dtype
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    default_config = config is None
    config = MosaicDecodeConfig.default(head_dim) if config is None else config
    _check(dtype, page_size, head_dim, group, config)
    max_steps = _max_steps(pages_per_seq * page_size, sliding_window, config.block_kv)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seq_slots, num_kv_heads, max_steps, num_sms=device_num_sms()
        )
    if num_splits == 1:
        partials = ()
        partial_dtype = dtype
    else:
        partials = (num_splits,)
        partial_dtype = jnp.float32
    out_types = (
        jax.ShapeDtypeStruct((num_seq_slots, *partials, num_q_heads, head_dim), partial_dtype),
        jax.ShapeDtypeStruct((num_seq_slots, *partials, num_q_heads), jnp.float32),
    )
    num_items = num_kv_heads * num_splits * num_seq_slots
    if rope is not None and num_items > device_num_sms():
        raise ValueError(f"a RopeFold call runs a grid of items; got {num_items} for the SMs")
    if config.persistent and num_items <= device_num_sms():
        # One item a program either way; the grid of items skips the persistent loop's output
        # staging and waits (the `1b` shape at B=16: 23.9 against 25.0 us a call, run 88).
        config = dataclasses.replace(config, persistent=False)
    elif default_config and config.persistent and head_dim == 128 and 64 % page_size == 0:
        # Persistent programs at D=128 by default take 64-key steps in two compute
        # warpgroups: the `1b` shape at B=64 74.3 against 76.8 us a call (run 111).
        config = dataclasses.replace(config, **_PERSISTENT_D128)
        max_steps = _max_steps(pages_per_seq * page_size, sliding_window, config.block_kv)
    chunk = pl.cdiv(max_steps, num_splits)
    num_programs = device_num_sms() if config.persistent else num_items
    ordering = slot_order.choose(config, pl.cdiv(num_items, device_num_sms()), num_seq_slots)
    body = decode_body.make_body(
        group=group,
        page_size=page_size,
        num_splits=num_splits,
        chunk=chunk,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        config=config,
        num_programs=num_programs,
        items_per_program=pl.cdiv(num_items, num_programs),
        ordering=ordering,
        rope=rope,
    )
    scratch = decode_body.scratch(
        config,
        dtype,
        partial_dtype,
        head_dim,
        page_size,
        ordering,
        num_seq_slots,
        rope=rope is not None,
    )
    kernel_kwargs = dict(
        scratch_types=(scratch,),
        **(
            dict(grid=(num_programs,), grid_names=("program",))
            if config.persistent
            else dict(
                grid=(num_kv_heads, num_splits, num_seq_slots),
                grid_names=("kv_head", "split", "seq"),
            )
        ),
        num_threads=config.compute_warpgroups + 1,
        thread_name="wg",
        # tanh.approx is too coarse for the soft-capped logits' LSE tolerance.
        compiler_params=plgpu.CompilerParams(
            approx_math=logits_soft_cap is None, **_profile_params(profile_dir)
        ),
    )
    inputs = (*front, k_pages, v_pages, kv_lens, page_indices)
    if ordering == "xla":
        inputs += (slot_order.slots_by_length(kv_lens),)
    out, lse = launch(body, out_types, inputs, **kernel_kwargs)
    if num_splits == 1:
        return (out, lse) if merge else (out[:, None], lse[:, None])
    if not merge:
        return out, lse
    if mosaic_merge.takes(num_splits, num_q_heads, head_dim):
        return mosaic_merge.merge_splits(out, lse, out_dtype=dtype)
    return merge_splits(out, lse, out_dtype=dtype)


def _max_steps(max_kv_len: int, sliding_window: int | None, block_kv: int) -> int:
    """The most pipeline steps one sequence's visible keys can touch: all of the longest
    sequence the page table holds, or the steps a window can straddle."""
    steps = pl.cdiv(max_kv_len, block_kv)
    if sliding_window is not None:
        steps = min(steps, pl.cdiv(sliding_window - 1, block_kv) + 1)
    return max(steps, 1)


def _profile_params(profile_dir: str | None) -> dict:
    """CompilerParams that turn on Mosaic GPU's in-kernel profiler (diagnostics)."""
    if profile_dir is None:
        return {}
    return dict(profile_space=256, profile_dir=profile_dir, profile_bounds_check=True)


def _check_rope(qkv, cos, sin, q_scale, k_scale, k_pages, v_pages, slots, kv_lens, table):
    """`rope_append_decode_attention`'s shapes and dtypes, before anything is traced: one
    token per sequence slot everywhere (a slot past kv_lens would be read out of bounds)."""
    if qkv.ndim not in (4, 5) or qkv.shape[-2] < 3:
        raise ValueError(
            f"qkv must be [S, Hkv, G + 2, D] (or float32 partial sums [parts, S, Hkv, G + 2, "
            f"D]); got {qkv.shape}"
        )
    num_seq_slots, num_kv_heads, _, head_dim = qkv.shape[-4:]
    if (qkv.ndim == 5 and qkv.dtype != jnp.float32) or (
        qkv.ndim == 4 and qkv.dtype != k_pages.dtype
    ):
        raise ValueError(
            f"qkv must be float32 partial sums or in the pages' dtype {k_pages.dtype}; got "
            f"{qkv.dtype}{list(qkv.shape)}"
        )
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"k_pages and v_pages must match; got {k_pages.dtype}{list(k_pages.shape)} and "
            f"{v_pages.dtype}{list(v_pages.shape)}"
        )
    if k_pages.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"the pages' (Hkv, D) {k_pages.shape[2:]} must be qkv's {(num_kv_heads, head_dim)}"
        )
    per_slot = dict(slots=slots, kv_lens=kv_lens, page_indices=table, cos=cos, sin=sin)
    for name, array in per_slot.items():
        if array.shape[:1] != (num_seq_slots,):
            raise ValueError(
                f"{name} must have one row per sequence slot of qkv (S={num_seq_slots}); got "
                f"{list(array.shape)}"
            )
    if cos.shape != sin.shape or cos.shape[1:] != (head_dim // 2,):
        raise ValueError(f"cos and sin must be f32[S, D / 2]; got {cos.shape}, {sin.shape}")
    if (q_scale is None) != (k_scale is None):
        raise ValueError("q_scale and k_scale go together: pass both or neither")
    if q_scale is not None and (q_scale.shape, k_scale.shape) != ((head_dim,),) * 2:
        raise ValueError(
            f"q_scale and k_scale must be [D={head_dim}]; got {q_scale.shape}, {k_scale.shape}"
        )


def _check(dtype, page_size, head_dim, group, config) -> None:
    check_inputs("decode", dtype, head_dim, page_size, config, False)
    if decode_body.q_copy_rows(group) > decode_body.TILE_M:
        raise ValueError(
            f"implementation='mosaic' needs the query heads of one KV head to fit one 64-row "
            f"wgmma tile (Hq // Hkv <= 64 for multiples of 8, <= 56 otherwise); got "
            f"Hq // Hkv = {group}"
        )
    smem = decode_body.smem_bytes(config, head_dim, jnp.dtype(dtype).itemsize)
    check_smem(config, smem, head_dim)
