"""Split-KV paged decode attention for Hopper (sm_90), lowered through Mosaic GPU.

The work comes in items, one per (KV head, split, sequence slot). The kernel needs 175-245
registers per thread, so one program runs per SM; by default (`MosaicDecodeConfig.persistent`)
the grid has one program per SM and each walks its items of a snake order, longest sequences
first, so that an SM fills its K/V pipeline once rather than once per item. Two warpgroups per
program:

* the copy warpgroup reads page ids from the page table and brings every page of K and V into
  shared memory with its own TMA copy (a `[page_size, D]` box of the strided view
  `k_pages[page, :, kv_head, :]`), `block_kv // page_size` pages per pipeline step and
  `num_stages` steps ahead of compute, running on from one item into the next;
* the compute warpgroup holds the GQA group's query heads as the rows of a 64-row score tile
  (the `wgmma` M; rows past the group are discarded), runs `wgmma` for Q K^T and P V with a
  base-2 online softmax in between, releases each stage as soon as its product is done, and
  writes its group's rows straight into the final layout (`[S, Hq, D]`, or `[S, splits, Hq, D]`
  partials).

Split `i` covers the fixed pipeline steps `[i * chunk, (i + 1) * chunk)` of the visible range
(a split past a short sequence's end loops zero times), so that in a ragged batch no item is
longer than one chunk. With one split the kernel's outputs are final (page-table and length
clamps happen in the kernel); with more, the f32 partials are merged in XLA
(`pallas_kernels.common.merge_splits`). Bytes past `kv_len` (the tail of the last page, pages
named by garbage table entries, keys before a sliding window) may be loaded, but never reach
the output: their logits are replaced by -inf and, on the at most two steps per sequence that
hold such rows, their V rows are zeroed in shared memory before the P V product (P is exactly
0 there, but 0 * NaN is NaN).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref

from pallas_kernels.common import (
    H200_NUM_SMS,
    device_num_sms,
    finalize,
    logits_base2,
    merge_splits,
    online_softmax_step,
    poison_enabled,
    poisoned,
    visible,
)
from pallas_kernels.mosaic.common import (
    check_inputs,
    check_pipeline,
    check_smem,
    default_block_kv,
    takes,
)

_TILE_M = 64  # `wgmma` M: the rows of the score tile.
_SWIZZLE = 128  # bytes; every supported D is a multiple of the 64 16-bit elements this spans.
_SWIZZLE_ELEMS = _SWIZZLE // 2
# Shared memory the default configs give the K/V stages: enough bytes in flight per SM for HBM
# latency at 1/132 of the H200's bandwidth, and one program per SM.
_DEFAULT_STAGE_BYTES = 128 * 1024
# A split does at least this many pipeline steps (when the sequence has them). One: with SMs
# left idle, a short sequence split to one step per program finishes sooner than with fewer,
# longer splits, though each pays the pipeline fill (benchmarks/NOTES.md, session 8).
_MIN_STEPS_PER_SPLIT = 1
# Batches of up to this many slots (one per thread of a warpgroup) are ordered by length
# inside the kernel (`_ordering`): at 256 the count cost more than XLA's sort (H200 run 38).
_MAX_SLOTS_RANKED = 128


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Tuning knobs of the Mosaic GPU decode kernel.

    Attributes:
      block_kv: KV tokens per pipeline step, the N of the Q K^T `wgmma`: a multiple of 64 and
        of `page_size`, at most 256. Each step copies `block_kv // page_size` pages of K and
        of V, one TMA copy per page.
      num_stages: pipeline steps of K and V buffered in shared memory, i.e. how far the copy
        warpgroup runs ahead of compute. Shared memory per stage is `2 * block_kv * D * 2`
        bytes. One program runs per SM whatever its shared memory: the kernel needs 175
        (block_kv 64) to 245 (block_kv 128) registers per thread (ptxas, run 17), more than
        two programs of 256 threads can have.
      longest_first: take the sequences in order of decreasing kv_len (splits of a
        sequence in order, all first splits before any second one), so that in a ragged
        batch no SM is left with a long item at the end. Up to `_MAX_SLOTS_RANKED` slots
        each program ranks them in shared memory as it starts; more take one XLA sort of
        `kv_lens` per call (`_ordering`). Persistent programs with at most one item each
        skip the order.
      persistent: launch one program per SM (or per item, if fewer), each walking its items
        (KV head, split, slot) of a snake order (`_snake_item`) with one K/V pipeline: the
        next item's pages stream in while the last one finishes, so an SM pays the pipeline
        fill once, not once per item. With `longest_first` the snake deals long and short
        items alike to every SM. The default (with `longest_first`): on the H200 (run 18)
        a ragged batch went from 3.49 to 3.90 TB/s of KV, uniform ones stayed within 2%.
    """

    block_kv: int = 128
    num_stages: int = 2
    longest_first: bool = True
    persistent: bool = True

    def __post_init__(self):
        check_pipeline(self.block_kv, self.num_stages)


def default_config(head_dim: int) -> MosaicDecodeConfig:
    """The config used when `config=None`: steps of 128 tokens (64 at D=256) and as many
    stages as 128 KiB of K/V hold (4 at D=64, 2 at D=128 and 256): the best of the H200 run
    of 2026-11-29 at D=128. Persistent programs with the longest sequences first, except at
    D=256, where the 64 KiB of float32 output staging leave a persistent program too little
    room beside two stages."""
    block_kv = default_block_kv(head_dim)
    stage_bytes = 2 * block_kv * head_dim * 2
    return MosaicDecodeConfig(
        block_kv=block_kv,
        num_stages=_DEFAULT_STAGE_BYTES // stage_bytes,
        persistent=head_dim <= 128,
    )


def supports(head_dim: int, page_size: int, group: int) -> bool:
    """Whether the kernel with `default_config(head_dim)` takes bf16/f16 inputs of head dim
    `head_dim`, pages of `page_size` and `group` query heads per KV head (the checks of
    `paged_decode_attention`, without raising)."""
    block_kv = default_config(head_dim).block_kv
    return takes(head_dim, page_size, block_kv) and _q_rows(group) <= _TILE_M


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
      config: `MosaicDecodeConfig`; None: `default_config(D)`.
      interpret: must be False: Mosaic GPU's interpreter cannot run `wgmma` (jax 0.11.2).
      profile_dir: diagnostics only: every call writes a trace of each program's named
        regions (Mosaic GPU's in-kernel profiler) as JSON into this directory.

    Returns:
      `out` [S, Hq, D] in q's dtype and `lse` f32[S, Hq] (natural log); inactive slots give 0
      and -inf. Invalid metadata inside `jit` may give wrong numbers but no out-of-bounds
      access (it is clamped as by `pallas_kernels.common.sanitize_metadata`).
    """
    num_seq_slots, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    config = default_config(head_dim) if config is None else config
    _check(q, page_size, head_dim, group, config, interpret)
    max_steps = _max_steps(pages_per_seq * page_size, sliding_window, config.block_kv)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seq_slots, num_kv_heads, max_steps, num_sms=device_num_sms()
        )
    q_rows = _q_rows(group)
    if num_q_heads < q_rows:
        # The Q copy is a box of q_rows heads; smaller q gets padded so the box fits. Larger q
        # needs no copy: TMA reads rows past the end as zeros.
        q = jnp.pad(q, ((0, 0), (0, q_rows - num_q_heads), (0, 0)))

    if num_splits == 1:
        partials = ()
        partial_dtype = q.dtype
    else:
        partials = (num_splits,)
        partial_dtype = jnp.float32
    out_types = (
        jax.ShapeDtypeStruct((num_seq_slots, *partials, num_q_heads, head_dim), partial_dtype),
        jax.ShapeDtypeStruct((num_seq_slots, *partials, num_q_heads), jnp.float32),
    )
    chunk = pl.cdiv(max_steps, num_splits)
    num_items = num_kv_heads * num_splits * num_seq_slots
    num_programs = min(num_items, device_num_sms()) if config.persistent else num_items
    ordering = _ordering(config, pl.cdiv(num_items, num_programs), num_seq_slots)
    body = _make_body(
        group=group,
        q_rows=q_rows,
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
    )
    tiled = (
        plgpu.TilingTransform((8, _SWIZZLE_ELEMS)),
        plgpu.SwizzleTransform(_SWIZZLE),
    )
    stages, block_kv = config.num_stages, config.block_kv
    kv_buffer = plgpu.SMEM((stages, block_kv, head_dim), q.dtype, transforms=tiled)
    staging = (
        plgpu.SMEM((_TILE_M, head_dim), partial_dtype),
        plgpu.SMEM((_TILE_M,), jnp.float32),
    )
    scratch = (
        plgpu.SMEM((_TILE_M, head_dim), q.dtype, transforms=tiled),
        # One program, one item: the K/V stages and the output staging buffers live at
        # disjoint times. Persistent programs need both at once.
        plgpu.RefUnion((kv_buffer, kv_buffer, *staging))
        if config.persistent
        else plgpu.RefUnion((kv_buffer, kv_buffer), staging),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
        plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    )
    if ordering == "kernel":  # the slots' lengths and their order (`_order_slots`)
        scratch += (
            plgpu.SMEM((num_seq_slots,), jnp.int32),
            plgpu.SMEM((num_seq_slots,), jnp.int32),
            plgpu.Barrier(),
        )
    kernel_kwargs = dict(
        scratch_types=scratch,
        **(
            dict(grid=(num_programs,), grid_names=("program",))
            if config.persistent
            else dict(
                grid=(num_kv_heads, num_splits, num_seq_slots),
                grid_names=("kv_head", "split", "seq"),
            )
        ),
        num_threads=2,
        thread_name="wg",
        # tanh.approx is too coarse for the soft-capped logits' LSE tolerance.
        compiler_params=plgpu.CompilerParams(
            approx_math=logits_soft_cap is None, **_profile_params(profile_dir)
        ),
    )
    inputs = (q, k_pages, v_pages, kv_lens, page_indices)
    if ordering == "xla":
        inputs += (_slots_by_length(kv_lens),)
    if poison_enabled():
        # Outputs start as NaN so that tests see any element the kernel fails to write: refs
        # passed in are aliased to the kernel's outputs.
        out_refs = tuple(jax.new_ref(poisoned(t)) for t in out_types)
        plgpu.kernel(body, out_type=(), **kernel_kwargs)(*inputs, *out_refs)
        out, lse = (r[...] for r in out_refs)
    else:
        out, lse = plgpu.kernel(body, out_type=out_types, **kernel_kwargs)(*inputs)
    if num_splits == 1:
        return out, lse
    return merge_splits(out, lse, out_dtype=q.dtype)


def _profile_params(profile_dir: str | None) -> dict:
    """CompilerParams that turn on Mosaic GPU's in-kernel profiler (diagnostics)."""
    if profile_dir is None:
        return {}
    return dict(profile_space=256, profile_dir=profile_dir, profile_bounds_check=True)


def _ordering(config: MosaicDecodeConfig, items_per_program: int, num_seq_slots: int):
    """How a call orders its slots by length (`longest_first`): None (a persistent program
    with one item at most has no order to choose), "kernel" (each program counts ranks in
    shared memory, `_order_slots`: no extra kernel, but its time grows with the square of
    the slots) or "xla" (one XLA sort kernel, 2.4 µs, for more than `_MAX_SLOTS_RANKED`)."""
    if not (config.longest_first and (items_per_program > 1 or not config.persistent)):
        return None
    return "kernel" if num_seq_slots <= _MAX_SLOTS_RANKED else "xla"


def _slots_by_length(kv_lens: jax.Array) -> jax.Array:
    """Slot ids in order of increasing kv_len: one XLA sort kernel and nothing else (the
    slot ids sorted along are a constant; the kernel walks the order from its end)."""
    slots = jnp.asarray(np.arange(kv_lens.shape[0], dtype=np.int32))
    return lax.sort((kv_lens, slots), num_keys=1)[1]


def _max_steps(max_kv_len: int, sliding_window: int | None, block_kv: int) -> int:
    """The most pipeline steps one sequence's visible keys can touch: all of the longest
    sequence the page table holds, or the steps a window can straddle."""
    steps = pl.cdiv(max_kv_len, block_kv)
    if sliding_window is not None:
        steps = min(steps, pl.cdiv(sliding_window - 1, block_kv) + 1)
    return max(steps, 1)


def _make_body(
    *,
    group,
    q_rows,
    page_size,
    num_splits,
    chunk,
    sm_scale,
    sliding_window,
    logits_soft_cap,
    config,
    num_programs,
    items_per_program,
    ordering,
):
    """The kernel body. Work comes in items, one (KV head, split, sequence slot) each. Without
    `config.persistent` the grid is the items themselves; with it, each of the grid's programs
    walks `items_per_program` items of the snake order (`_snake_item`), the copy warpgroup
    running on into the next item's pages while compute finishes the last one's steps."""
    block_kv, stages = config.block_kv, config.num_stages
    pages_per_step = block_kv // page_size

    def body(q_ref, k_ref, v_ref, lens_ref, table_ref, *refs):
        if ordering == "xla":
            order_ref, *refs = refs
        (
            out_ref,
            lse_ref,
            q_smem,
            buffers,
            q_barrier,
            k_ready,
            v_ready,
            k_free,
            v_free,
            *order_refs,
        ) = refs
        if ordering == "kernel":
            lens_smem, order_ref, order_ready = order_refs
        # Where kv_lens are read: the shared-memory copy of `_order_slots`, if any.
        lens = lens_smem if ordering == "kernel" else lens_ref
        if config.persistent:  # the output staging buffers outlive an item's K/V stages
            ((k_smem, v_smem, o_smem, lse_smem),) = buffers
        else:  # they live at disjoint times
            (k_smem, v_smem), (o_smem, lse_smem) = buffers
        num_kv_heads = k_ref.shape[2]
        num_pages = k_ref.shape[0]
        pages_per_seq = table_ref.shape[1]
        num_seq_slots = lens_ref.shape[0]

        def item_of(index):
            """(KV head, split, slot) of an item. `index` counts KV heads fastest, then
            splits, then slots; or, ordered (`longest_first`), KV heads, then slots from the
            longest down (`order_ref`: longest first from `_order_slots`, shortest first
            from `_slots_by_length`), then splits."""
            kv_head = lax.rem(index, num_kv_heads)
            unit = index // num_kv_heads
            if ordering is None:
                return kv_head, lax.rem(unit, num_splits), unit // num_splits
            rank = lax.rem(unit, num_seq_slots)
            if ordering == "xla":
                rank = num_seq_slots - 1 - rank
            seq = jnp.clip(order_ref[rank], 0, num_seq_slots - 1)
            return kv_head, unit // num_seq_slots, seq

        def steps_of(split, seq, valid):
            """kv_len, the item's first pipeline step and how many it takes (0 if `valid` is
            False; None: always valid)."""
            # The clamps of `sanitize_metadata`, done here to save XLA kernels per call: bad
            # metadata gives wrong numbers, never an out-of-bounds read.
            kv_len = jnp.clip(lens[seq], 0, pages_per_seq * page_size)
            # Steps [first, end) hold every visible key; this split takes `chunk` of them.
            if sliding_window is None:
                first = jnp.int32(0)
            else:
                first = jnp.maximum(kv_len - sliding_window, 0) // block_kv
            end = pl.cdiv(kv_len, block_kv)
            step0 = first + split * chunk
            num_steps = jnp.clip(end - step0, 0, chunk)
            if valid is not None:
                num_steps = jnp.where(valid, num_steps, 0)
            return kv_len, step0, num_steps

        def fill_stage(src, dst, ready, free, kv_head, count, slot, pages):
            """One TMA copy per page into stage `slot`, once compute has released it."""

            @pl.when(count >= stages)
            def _wait_free():
                plgpu.barrier_wait(free.at[slot])

            for j, page in enumerate(pages):
                plgpu.copy_gmem_to_smem(
                    src.at[page, :, kv_head, :],
                    dst.at[slot, pl.ds(j * page_size, page_size)],
                    ready.at[slot],
                )

        def copy_item(kv_head, split, seq, valid, count):
            """Copies every page of the item; `count` numbers pipeline steps across items."""
            kv_len, step0, num_steps = steps_of(split, seq, valid)
            # Table entries past the last page are garbage: reload the last page instead
            # (an L2 hit); its rows are masked like every row past kv_len.
            last_page = (jnp.maximum(kv_len, 1) - 1) // page_size

            def step(i, count):
                slot = lax.rem(count, stages)
                first_page = (step0 + i) * pages_per_step
                pages = [
                    jnp.clip(
                        table_ref[seq, jnp.minimum(first_page + j, last_page)], 0, num_pages - 1
                    )
                    for j in range(pages_per_step)
                ]
                # K first: its stage is released before V's (after Q K^T, not P V).
                fill_stage(k_ref, k_smem, k_ready, k_free, kv_head, count, slot, pages)
                fill_stage(v_ref, v_smem, v_ready, v_free, kv_head, count, slot, pages)
                return count + 1

            return lax.fori_loop(0, num_steps, step, count)

        @jax.named_scope("epilogue")
        def write_output(kv_head, split, seq, acc, m, l):
            out, lse = finalize(acc, m, l)
            if config.persistent:  # the previous item's output copy must have read o_smem
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[...] = out.astype(o_smem.dtype)
            lse_smem[...] = lse
            plgpu.commit_smem()
            # The group sits at rows [tile_row, tile_row + group) of the tile (`_q_tile_start`);
            # only those rows are written, at the group's heads of the final layout.
            tile_row = lax.rem(kv_head * group, 8)
            heads = pl.ds(kv_head * group, group)
            out_dst, lse_dst = (
                (out_ref, lse_ref)
                if num_splits == 1
                else (out_ref.at[:, split], lse_ref.at[:, split])
            )
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(tile_row, group)], out_dst.at[seq, heads])
            # A TMA box needs 16-byte rows, more than a small group's LSEs: plain stores.
            for r in range(group):
                lse_dst[seq, kv_head * group + r] = lse_smem[tile_row + r]
            if not config.persistent:
                plgpu.wait_smem_to_gmem(0)

        def compute_item(kv_head, split, seq, valid, count):
            """Attention of the item's query heads over its steps; returns the step count."""
            kv_len, step0, num_steps = steps_of(split, seq, valid)
            plgpu.copy_gmem_to_smem(
                q_ref.at[seq, pl.ds(_q_tile_start(kv_head, group), q_rows)],
                q_smem.at[pl.ds(0, q_rows)],
                q_barrier,
            )
            head_dim = q_smem.shape[-1]
            acc = plgpu.layout_cast(jnp.zeros((_TILE_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
            row = plgpu.Layout.WGMMA.reduce(1)
            m = plgpu.layout_cast(jnp.full((_TILE_M,), -jnp.inf, jnp.float32), row)
            l = plgpu.layout_cast(jnp.zeros((_TILE_M,), jnp.float32), row)
            with jax.named_scope("wait_q"):
                plgpu.barrier_wait(q_barrier)

            def step(i, carry):
                acc, m, l = carry
                slot = lax.rem(count + i, stages)
                start = (step0 + i) * block_kv
                with jax.named_scope("wait_k"):
                    plgpu.barrier_wait(k_ready.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((_TILE_M, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                key = start + plgpu.broadcasted_iota(
                    jnp.int32, (_TILE_M, block_kv), 1, layout=plgpu.Layout.WGMMA
                )
                ok = visible(kv_len - 1, key, kv_len, causal=False, sliding_window=sliding_window)
                # NaN logits of keys past kv_len are replaced here, never used.
                logits2 = jnp.where(ok, logits_base2(s, sm_scale, logits_soft_cap), -jnp.inf)
                m, l, alpha, p = online_softmax_step(m, l, logits2)
                acc = acc * alpha[:, None]
                with jax.named_scope("wait_v"):
                    plgpu.barrier_wait(v_ready.at[slot])

                has_invisible = start + block_kv > kv_len
                if sliding_window is not None:
                    has_invisible |= start <= kv_len - 1 - sliding_window

                @pl.when(has_invisible)
                def _zero_invisible_v():
                    v_tile = v_smem.at[slot]
                    key_of_row = start + plgpu.broadcasted_iota(
                        jnp.int32, v_tile.shape, 0, layout=plgpu.Layout.WGMMA
                    )
                    row_ok = visible(
                        kv_len - 1,
                        key_of_row,
                        kv_len,
                        causal=False,
                        sliding_window=sliding_window,
                    )
                    v_tile[...] = jnp.where(row_ok, v_tile[...], 0)
                    plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p.astype(v_smem.dtype), v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, l

            with jax.named_scope("steps"):
                acc, m, l = lax.fori_loop(0, num_steps, step, (acc, m, l))

            if valid is None:
                write_output(kv_head, split, seq, acc, m, l)
            else:
                pl.when(valid)(lambda: write_output(kv_head, split, seq, acc, m, l))

            return count + num_steps

        wg = lax.axis_index("wg")
        if config.persistent:
            program = lax.axis_index("program")
            num_items = num_kv_heads * num_splits * num_seq_slots

            def run(work):
                """`work` on each of this program's items of the snake order."""

                def item(k, count):
                    index = _snake_item(k, program, num_programs)
                    valid = index < num_items
                    kv_head, split, seq = item_of(jnp.minimum(index, num_items - 1))
                    return work(kv_head, split, seq, valid, count)

                lax.fori_loop(0, items_per_program, item, jnp.int32(0))

        else:
            index = lax.axis_index("kv_head") + num_kv_heads * (
                lax.axis_index("split") + num_splits * lax.axis_index("seq")
            )

            def run(work):
                """`work` on this program's one item."""
                kv_head, split, seq = item_of(index)
                work(kv_head, split, seq, None, jnp.int32(0))

        @pl.when(wg == 1)
        @jax.named_scope("copy")
        def _copy():
            if ordering == "kernel":  # the copy warpgroup orders the slots for both
                with jax.named_scope("order"):
                    _order_slots(lens_ref, lens_smem, order_ref)
                    plgpu.barrier_arrive(order_ready)
            run(copy_item)

        @pl.when(wg == 0)
        @jax.named_scope("compute")
        def _compute():
            if ordering == "kernel":
                plgpu.barrier_wait(order_ready)
            run(compute_item)
            if config.persistent:  # one item per program waits in `write_output`
                plgpu.wait_smem_to_gmem(0)

    return body


def _snake_item(k, program, num_programs):
    """The item that `program` takes k-th in a persistent grid: rounds of `num_programs`
    items, dealt forward in even rounds and backward in odd ones, so that with items sorted
    longest first (`longest_first`) every program gets a long and a short one in turn."""
    forward = lax.rem(k, 2) == 0
    return k * num_programs + jnp.where(forward, program, num_programs - 1 - program)


def _order_slots(lens_ref, lens_smem, order_smem):
    """Ranks the slots by kv_len, longest first (ties: lower slot first), in the calling
    warpgroup: `lens_smem` gets the lengths and `order_smem[r]` the slot of rank r.

    Which program takes which item changes no number (each item's arithmetic is its own),
    only how evenly the programs are loaded, so this replaces the XLA sort kernel of earlier
    versions (2.4 µs a call, H200 run 19) by a count in shared memory: each thread takes slots
    `t, t + 128, ...` and counts the slots that rank before them. Pallas Mosaic GPU has no
    per-thread loops or scatter stores, so this is written against Mosaic GPU directly."""
    num = lens_ref.shape[0]
    owned = -(-num // 128)  # slots per thread
    unroll = next(u for u in (8, 4, 2, 1) if num % u == 0)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def rank(_, lens_gmem, lens_s, order_s):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        c = mgpu_utils.c
        thread = arith.remui(mgpu_utils.thread_idx(), c(128, i32))
        slots = [arith.addi(thread, c(128 * k, i32)) for k in range(owned)]
        in_range = [arith.cmpi(arith.CmpIPredicate.slt, j, c(num, i32)) for j in slots]
        for j, ok in zip(slots, in_range, strict=True):
            with mgpu_utils.when(ok):
                jx = arith.index_cast(index, j)
                memref.store(memref.load(lens_gmem, [jx]), lens_s, [jx])
        mgpu_utils.warpgroup_barrier()
        # Out-of-range slots compare against slot 0's length; their counts are dropped.
        mine = [
            memref.load(lens_s, [arith.index_cast(index, arith.select(ok, j, c(0, i32)))])
            for j, ok in zip(slots, in_range, strict=True)
        ]

        @mgpu_utils.fori(c(num // unroll, index), [c(0, i32)] * owned)
        def counts(block, counts):
            for u in range(unroll):
                i = arith.addi(arith.muli(block, c(unroll, index)), c(u, index))
                len_i = memref.load(lens_s, [i])
                i_i32 = arith.index_cast(i32, i)
                new = []
                for count, j, len_j in zip(counts, slots, mine, strict=True):
                    longer = arith.cmpi(arith.CmpIPredicate.sgt, len_i, len_j)
                    tie_before = arith.andi(
                        arith.cmpi(arith.CmpIPredicate.eq, len_i, len_j),
                        arith.cmpi(arith.CmpIPredicate.slt, i_i32, j),
                    )
                    before = arith.extui(i32, arith.ori(longer, tie_before))
                    new.append(arith.addi(count, before))
                counts = new
            return counts

        for j, ok, rank_j in zip(slots, in_range, counts.results, strict=True):
            with mgpu_utils.when(ok):
                memref.store(j, order_s, [arith.index_cast(index, rank_j)])
        mgpu_utils.warpgroup_barrier()

    rank(lens_ref, lens_smem, order_smem)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _q_tile_start(kv_head, group):
    """First head of the Q copy of `kv_head`: its group's first head rounded down to a multiple
    of 8, because a TMA copy into tiled shared memory must start on a tile row. The group then
    sits at rows `kv_head * group % 8 ...` of the score tile."""
    return pl.multiple_of(kv_head * group // 8 * 8, 8)


def _q_rows(group: int) -> int:
    """Rows of the Q copy: whole 8-row tiles covering the group at any start offset."""
    max_offset = 0 if group % 8 == 0 else 8 - math.gcd(group, 8)
    return _round_up(group + max_offset, 8)


def _check(q, page_size, head_dim, group, config, interpret) -> None:
    check_inputs("decode", q.dtype, head_dim, page_size, config, interpret)
    if _q_rows(group) > _TILE_M:
        raise ValueError(
            f"implementation='mosaic' needs the query heads of one KV head to fit one 64-row "
            f"wgmma tile (Hq // Hkv <= 64 for multiples of 8, <= 56 otherwise); got "
            f"Hq // Hkv = {group}"
        )
    smem = _smem_bytes(config, head_dim, jnp.dtype(q.dtype).itemsize)
    check_smem(config, smem, head_dim)


def _smem_bytes(config: MosaicDecodeConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory of one program: the K and V stages and the Q tile, and for persistent
    programs the output staging buffers (float32 partials at most) besides."""
    smem = (2 * config.num_stages * config.block_kv + _TILE_M) * head_dim * itemsize
    if config.persistent:
        smem += _TILE_M * (head_dim + 1) * 4
    if config.longest_first:  # at most, the lengths and order of `_order_slots`
        smem += 2 * _MAX_SLOTS_RANKED * 4
    return smem
