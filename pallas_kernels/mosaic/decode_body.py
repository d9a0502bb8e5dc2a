"""The body of the Mosaic GPU decode kernel (`pallas_kernels.mosaic.paged_decode`) and the
shared memory it works in.

Two or three warpgroups per program:

* the copy warpgroup reads page ids from the page table and brings every page of K and V into
  shared memory (`pipeline.copy_step`), `block_kv // page_size` pages per pipeline step and
  `num_stages` steps ahead of compute, running on from one item into the next;
* the compute warpgroup holds the GQA group's query heads as the rows of a 64-row score tile
  (the `wgmma` M; rows past the group are discarded), runs `wgmma` for Q K^T and P V with a
  base-2 online softmax in between, releases each stage as soon as its product is done, and
  writes its group's rows straight into the final layout (`[S, Hq, D]`, or `[S, splits, Hq, D]`
  partials). In a persistent program it copies the next item's Q tile as soon as the item's
  last Q K^T has read the tile, so that the next item's first step does not wait for it;
* with `config.compute_warpgroups=2`, two compute warpgroups take the pipeline steps of
  alternate parity, so that one's softmax runs while the other's products do, and merge their
  states at each item's end (`compute_item`). Compute alone takes 58.7 us a call at the `1b`
  shape at B=64, against the page stream's 69.5 and the kernel's 75.8 (benchmarks/NOTES.md,
  run 110): the two overlap imperfectly.

With `RopeFold` (a grid of items, one compute warpgroup) the kernel also does the layer's
`rope_append`: the compute warpgroup builds its Q tile from the QKV projection with the
per-lane code of `pallas_kernels.mosaic.rope_append` while the first pages stream in, and the
new key's K/V row reaches the pages and the last stage from it (`rope_q`, `put_new_row`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (
    finalize,
    logits_base2,
    merge_online_states,
    online_softmax_step,
    visible,
)
from pallas_kernels.mosaic import pipeline, slot_order
from pallas_kernels.mosaic import rope_append as rope_rows

TILE_M = 64  # `wgmma` M: the rows of the score tile.


class Scratch(NamedTuple):
    """The kernel's scratch refs (or, given to `plgpu.kernel`, their types), in the order
    Mosaic GPU allocates them."""

    q_smem: Any  # [TILE_M, D] in q's dtype: the Q tile
    # (k_smem, v_smem, o_smem, lse_smem): the K and V stages [stages, block_kv, D] and the
    # output staging buffers ([TILE_M, D] out, f32[TILE_M] lse), one union (see `scratch`)
    buffers: Any
    q_barrier: Any
    k_ready: Any  # per stage: its K pages arrived (one arrival per page copy)
    v_ready: Any
    k_free: Any  # per stage: compute is done with its K
    v_free: Any
    lens_smem: Any = None  # ordering "kernel": i32[S] the slots' kv_lens (`order_slots`)
    order_smem: Any = None  # ... and i32[S] the slot of each rank
    order_ready: Any = None  # ... and the barrier the compute warpgroups wait on
    # Two compute warpgroups: the second one's state (f32 acc [TILE_M, D], m, l [TILE_M])
    # handed to the first at each item's end, and the barriers of the handoff.
    merge_smem: Any = None
    merge_ready: Any = None
    merge_free: Any = None
    new_kv: Any = None  # with `RopeFold`: [2, D] the new token's k and v rows, in q's dtype


class RopeFold(NamedTuple):
    """The kernel also does `rope_append` (`paged_decode.rope_append_decode_attention`): its
    compute warpgroup builds the Q tile from the QKV projection (qk-norm with `qk_norm`, RoPE)
    instead of copying it, the split whose steps hold the new key writes k and v into the
    pages, and that split's last step puts them in its K and V stages in place of what the
    page copy brought (which may predate the write)."""

    eps: float
    qk_norm: bool


def scratch(config, dtype, partial_dtype, head_dim, page_size, ordering, num_seq_slots, rope=False):
    """The `Scratch` types of a call: K/V stages of `dtype`, output staging in
    `partial_dtype` (q's dtype with one split, float32 partials with more), and with `rope`
    (a `RopeFold` call) the new k and v rows."""
    stages, block_kv = config.num_stages, config.block_kv
    kv_buffer = plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=pipeline.TILED)
    staging = (
        plgpu.SMEM((TILE_M, head_dim), partial_dtype),
        plgpu.SMEM((TILE_M,), jnp.float32),
    )
    order = (None, None, None)
    if ordering == "kernel":
        order = (
            plgpu.SMEM((num_seq_slots,), jnp.int32),
            plgpu.SMEM((num_seq_slots,), jnp.int32),
            plgpu.Barrier(),
        )
    merge = ()
    if config.compute_warpgroups == 2:
        merge = (
            (
                plgpu.SMEM((TILE_M, head_dim), jnp.float32),
                plgpu.SMEM((TILE_M,), jnp.float32),
                plgpu.SMEM((TILE_M,), jnp.float32),
            ),
            plgpu.Barrier(),
            plgpu.Barrier(),
        )
    return Scratch(
        plgpu.SMEM((TILE_M, head_dim), dtype, transforms=pipeline.TILED),
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
        *order,
        *(merge or (None, None, None)),
        plgpu.SMEM((2, head_dim), dtype) if rope else None,
    )


def smem_bytes(config, head_dim: int, itemsize: int) -> int:
    """Shared memory of one program (`scratch`), at most: the K and V stages, the Q tile and
    a `RopeFold` call's new k and v rows, for persistent programs the output staging buffers
    (float32 partials at most) besides, and with `longest_first` the lengths and order of
    `order_slots`."""
    smem = (2 * config.num_stages * config.block_kv + TILE_M + 2) * head_dim * itemsize
    if config.persistent:
        smem += TILE_M * (head_dim + 1) * 4
    if config.longest_first:
        smem += 2 * slot_order.MAX_SLOTS_RANKED * 4
    if config.compute_warpgroups == 2:
        smem += TILE_M * (head_dim + 2) * 4
    return smem


def make_body(
    *,
    group,
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
    rope: RopeFold | None = None,
):
    """The kernel body. Work comes in items, one (KV head, split, sequence slot) each. Without
    `config.persistent` the grid is the items themselves; with it, each of the grid's programs
    walks `items_per_program` items of the snake order (`snake_item`), the copy warpgroup
    running on into the next item's pages while compute finishes the last one's steps.

    The body takes the refs of q, k_pages, v_pages, kv_lens and page_indices, with `ordering`
    "xla" the slot order (`slot_order.slots_by_length`), then out and lse, then `Scratch`.
    With `rope` (a grid of items, one compute warpgroup) q's place is taken by the refs of
    `rope_append_decode_attention`'s qkv, cos, sin, the q and k scales (with `qk_norm`) and
    slots, and the pages are written."""
    block_kv, stages = config.block_kv, config.num_stages
    q_rows = q_copy_rows(group)
    if rope is not None and (config.persistent or config.compute_warpgroups != 1):
        raise ValueError("RopeFold takes a grid of items and one compute warpgroup")

    def body(*refs):
        if rope is None:
            q_ref, *refs = refs
        else:
            num_rope = 4 + 2 * rope.qk_norm
            rope_refs, refs = refs[:num_rope], refs[num_rope:]
        k_ref, v_ref, lens_ref, table_ref, *order_input, out_ref, lse_ref, scratch = refs
        if ordering == "kernel":  # where kv_lens are read: the copy of `order_slots`
            lens, order_ref = scratch.lens_smem, scratch.order_smem
        else:
            lens, order_ref = lens_ref, (order_input[0] if ordering == "xla" else None)
        if config.persistent:  # the output staging buffers outlive an item's K/V stages
            ((k_smem, v_smem, o_smem, lse_smem),) = scratch.buffers
        else:  # they live at disjoint times
            (k_smem, v_smem), (o_smem, lse_smem) = scratch.buffers
        q_smem, q_barrier = scratch.q_smem, scratch.q_barrier
        k_ready, v_ready = scratch.k_ready, scratch.v_ready
        k_free, v_free = scratch.k_free, scratch.v_free
        kv = ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free))
        num_kv_heads = k_ref.shape[2]
        pages_per_seq = table_ref.shape[1]
        num_seq_slots = lens_ref.shape[0]

        def item_of(index):
            """(KV head, split, slot) of an item. `index` counts KV heads fastest, then
            splits, then slots: in slot order, or, ordered (`longest_first`), from the
            longest down (`order_ref`: longest first from `order_slots`, shortest first
            from `slots_by_length`). The splits of the longest slots thus come first: a
            batch with few long slots among many empty ones (the prefix call of
            `jaxpaged.shared_prefix_decode_attention`) spreads the long slots' splits over
            the first programs of the snake, one per program."""
            kv_head = lax.rem(index, num_kv_heads)
            unit = index // num_kv_heads
            split, rank = lax.rem(unit, num_splits), unit // num_splits
            if ordering is None:
                return kv_head, split, rank
            if ordering == "xla":
                rank = num_seq_slots - 1 - rank
            return kv_head, split, jnp.clip(order_ref[rank], 0, num_seq_slots - 1)

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

        def copy_item(kv_head, split, seq, valid, count):
            """Copies every page of the item; `count` numbers pipeline steps across items."""
            kv_len, step0, num_steps = steps_of(split, seq, valid)
            last = pipeline.last_page_of(kv_len, page_size)

            def step(i, count):
                slot = lax.rem(count, stages)
                pipeline.copy_step(
                    kv,
                    table_ref,
                    seq=seq,
                    block=step0 + i,
                    last_page=last,
                    kv_head=kv_head,
                    slot=slot,
                    step=count,
                )
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
            # The group sits at rows [tile_row, tile_row + group) of the tile (`q_tile_start`;
            # from 0 with `rope`); only those rows are written, at the group's heads of the
            # final layout.
            tile_row = lax.rem(kv_head * group, 8) if rope is None else 0
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

        @jax.named_scope("rope")
        def rope_q(kv_head, split, seq):
            """With `rope`: the group's Q tile rows [0, group) and the new k and v rows
            (`scratch.new_kv`) from the projection; the pages get k and v from the split that
            holds the new key (split 0 of an empty slot: as `rope_append`, a slot outside the
            pool writes nothing). Tile rows past the group are never written: their scores
            are garbage that no output row reads (rows do not mix).

            kv_len and the slot are read after the projection's loads are issued (`slot_of`),
            so that their round trip to memory overlaps those loads instead of preceding
            them."""
            parts, cos, sin, *scales, slots = rope_refs
            arg_types = (plgpu.RefType(),) * (5 + len(scales)) + (
                plgpu.RefType(pipeline.TILED),
                plgpu.RefType(),
                plgpu.RefType(),
                plgpu.RefType(),
                plgpu.Layout.WG_SPLAT(shape=()),
                plgpu.Layout.WG_SPLAT(shape=()),
            )

            @plgpu.inline_mgpu(arg_types=arg_types)
            def rows(ctx, parts, cos, sin, *refs):
                del ctx
                *scales, k_pages, v_pages, q_tile, new_kv, lens, slots, seq, split = refs
                i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
                seq = seq.registers.item()

                def c32(x):
                    return mgpu_utils.c(x, i32)

                def slot_of():
                    """The new key's slot for the split that holds it (as `steps_of` splits
                    the clamped kv_len), else -1."""
                    at = [arith.index_cast(index, seq)]
                    kv_len = memref.load(lens, at)
                    kv_len = arith.maxsi(
                        arith.minsi(kv_len, c32(pages_per_seq * page_size)), c32(0)
                    )
                    new_step = arith.divsi(
                        arith.subi(arith.maxsi(kv_len, c32(1)), c32(1)), c32(block_kv)
                    )
                    first_step = c32(0)
                    if sliding_window is not None:
                        first = arith.maxsi(arith.subi(kv_len, c32(sliding_window)), c32(0))
                        first_step = arith.divsi(first, c32(block_kv))
                    holder = arith.divsi(arith.subi(new_step, first_step), c32(chunk))
                    writer = arith.cmpi(arith.CmpIPredicate.eq, holder, split.registers.item())
                    return arith.select(writer, memref.load(slots, at), c32(-1))

                def store_q(row, lo, hi, rot_lo, rot_hi):
                    vector.store(rot_lo, q_tile, pipeline.tiled_indices(row, lo))
                    vector.store(rot_hi, q_tile, pipeline.tiled_indices(row, hi))

                def store_new(which, lo, hi, x_lo, x_hi):
                    which = mgpu_utils.c(which, ir.IndexType.get())
                    vector.store(x_lo, new_kv, [which, lo])
                    vector.store(x_hi, new_kv, [which, hi])

                rope_rows.emit_rope_rows(
                    parts,
                    cos,
                    sin,
                    scales or None,
                    slot_of,
                    k_pages,
                    v_pages,
                    eps=rope.eps,
                    store_q=store_q,
                    store_new=store_new,
                )

            rows(
                parts.at[:, seq, kv_head],
                cos.at[seq],
                sin.at[seq],
                *scales,
                k_ref.at[:, :, kv_head],
                v_ref.at[:, :, kv_head],
                q_smem,
                scratch.new_kv,
                lens_ref,
                slots,
                seq,
                split,
            )
            plgpu.commit_smem()  # the Q tile, for `wgmma`; the new rows, for `put_new_row`

        @jax.named_scope("new_row")
        def put_new_row(which, stage, row):
            """With `rope`: the new k (`which` 0) or v (1) row into row `row` of a K or V stage
            [block_kv, D] that its page copy has filled, then made visible to `wgmma`."""

            @plgpu.inline_mgpu(
                arg_types=(
                    plgpu.RefType(),
                    plgpu.RefType(pipeline.TILED),
                    plgpu.Layout.WG_SPLAT(shape=()),
                )
            )
            def put(ctx, new_kv, stage, row):
                del ctx
                index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
                head_dim = ir.MemRefType(new_kv.type).shape[1]
                dtype = ir.MemRefType(new_kv.type).element_type
                # 16 bytes a thread: D / 8 threads take the row.
                tid = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))
                row = arith.index_cast(index, row.registers.item())
                with mgpu_utils.when(
                    arith.cmpi(arith.CmpIPredicate.ult, tid, mgpu_utils.c(head_dim // 8, i32))
                ):
                    col = arith.index_cast(index, arith.muli(tid, mgpu_utils.c(8, i32)))
                    x = vector.load(
                        ir.VectorType.get([8], dtype),
                        new_kv,
                        [mgpu_utils.c(which, index), col],
                    )
                    vector.store(x, stage, pipeline.tiled_indices(row, col))

            put(scratch.new_kv, stage, row)
            plgpu.commit_smem()

        def copy_q(kv_head, seq):
            plgpu.copy_gmem_to_smem(
                q_ref.at[seq, pl.ds(q_tile_start(kv_head, group), q_rows)],
                q_smem.at[pl.ds(0, q_rows)],
                q_barrier,
            )

        pair = config.compute_warpgroups == 2

        def compute_item(kv_head, split, seq, valid, count, next_q=None, *, w=0):
            """Attention of the item's query heads over its steps, by compute warpgroup `w`;
            returns the step count.

            Without `next_q` the item copies its own Q tile first. A persistent program's
            items find theirs copied already: `next_q()` copies the next item's as soon as
            this one's last Q K^T has read the tile (or at once, for an item of no steps), so
            the copy's latency hides behind the item's last P V and its output write.

            With two compute warpgroups, warpgroup `w` takes the pipeline steps `count + i`
            of parity `w` (one's softmax runs while the other's products do), so that each
            waits on every phase of its own stages' barriers (a waiter tracks the phases by
            counting its waits: `num_stages` is even), and the second hands its
            online-softmax state to the first through shared memory at the item's end; the
            first merges the two, copies the next item's Q tile (both are done with this
            one's) and writes the output."""
            if rope is not None:  # first: the prologue's loads wait on nothing
                rope_q(kv_head, split, seq)
            kv_len, step0, num_steps = steps_of(split, seq, valid)
            if rope is not None:
                # The step and row of the new key, in the split whose steps hold it.
                new_i = jnp.where(kv_len > 0, (kv_len - 1) // block_kv - step0, -1)
                new_row = lax.rem(jnp.maximum(kv_len, 1) - 1, block_kv)
            elif next_q is None and w == 0:
                copy_q(kv_head, seq)
            head_dim = q_smem.shape[-1]
            acc = plgpu.layout_cast(jnp.zeros((TILE_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
            row = plgpu.Layout.WGMMA.reduce(1)
            m = plgpu.layout_cast(jnp.full((TILE_M,), -jnp.inf, jnp.float32), row)
            l = plgpu.layout_cast(jnp.zeros((TILE_M,), jnp.float32), row)
            if rope is None:
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_barrier)
            if next_q is not None and not pair:
                pl.when(num_steps == 0)(next_q)

            first = lax.rem(count + w, 2) if pair else 0  # the first step of parity w

            def step(j, carry):
                acc, m, l = carry
                i = first + 2 * j if pair else j
                slot = lax.rem(count + i, stages)
                start = (step0 + i) * block_kv
                with jax.named_scope("wait_k"):
                    plgpu.barrier_wait(k_ready.at[slot])
                if rope is not None:
                    pl.when(i == new_i)(lambda: put_new_row(0, k_smem.at[slot], new_row))

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((TILE_M, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if next_q is not None and not pair:
                    pl.when(i == num_steps - 1)(next_q)
                key = start + plgpu.broadcasted_iota(
                    jnp.int32, (TILE_M, block_kv), 1, layout=plgpu.Layout.WGMMA
                )
                ok = visible(kv_len - 1, key, kv_len, causal=False, sliding_window=sliding_window)
                # NaN logits of keys past kv_len are replaced here, never used.
                logits2 = jnp.where(ok, logits_base2(s, sm_scale, logits_soft_cap), -jnp.inf)
                m, l, alpha, p = online_softmax_step(m, l, logits2)
                acc = acc * alpha[:, None]
                with jax.named_scope("wait_v"):
                    plgpu.barrier_wait(v_ready.at[slot])
                if rope is not None:
                    pl.when(i == new_i)(lambda: put_new_row(1, v_smem.at[slot], new_row))

                pipeline.zero_invisible_v(v_smem.at[slot], start, kv_len, sliding_window)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p.astype(v_smem.dtype), v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, l

            my_steps = (num_steps - first + 1) // 2 if pair else num_steps
            with jax.named_scope("steps"):
                acc, m, l = lax.fori_loop(0, my_steps, step, (acc, m, l))

            if pair:
                (acc_smem, m_smem, l_smem) = scratch.merge_smem
                if w == 1:  # hand the state over; wait until it is read
                    with jax.named_scope("hand_over"):
                        acc_smem[...] = acc
                        m_smem[...] = m
                        l_smem[...] = l
                        plgpu.barrier_arrive(scratch.merge_ready)
                        plgpu.barrier_wait(scratch.merge_free)
                    return count + num_steps
                with jax.named_scope("merge"):
                    plgpu.barrier_wait(scratch.merge_ready)
                    if next_q is not None:
                        next_q()
                    acc, m, l = merge_online_states(
                        (acc, m, l), (acc_smem[...], m_smem[...], l_smem[...])
                    )
                    plgpu.barrier_arrive(scratch.merge_free)

            if valid is None:
                write_output(kv_head, split, seq, acc, m, l)
            else:
                pl.when(valid)(lambda: write_output(kv_head, split, seq, acc, m, l))

            return count + num_steps

        wg = lax.axis_index("wg")
        if config.persistent:
            program = lax.axis_index("program")
            num_items = num_kv_heads * num_splits * num_seq_slots

            def item_at(k):
                """(KV head, split, slot, valid) of the program's k-th item."""
                index = snake_item(k, program, num_programs)
                return *item_of(jnp.minimum(index, num_items - 1)), index < num_items

            def run(work, prefetch_q=False):
                """`work` on each of this program's items of the snake order; with
                `prefetch_q`, the first item's Q tile copied before and every item's
                `next_q` copying the next one's."""
                if prefetch_q:
                    kv_head, _, seq, _ = item_at(0)
                    copy_q(kv_head, seq)

                def item(k, count):
                    kv_head, split, seq, valid = item_at(k)
                    if not prefetch_q:
                        return work(kv_head, split, seq, valid, count)

                    def next_q():
                        @pl.when(k + 1 < items_per_program)
                        def _copy():
                            kv_head, _, seq, _ = item_at(k + 1)
                            copy_q(kv_head, seq)

                    return work(kv_head, split, seq, valid, count, next_q)

                lax.fori_loop(0, items_per_program, item, jnp.int32(0))

        else:
            index = lax.axis_index("kv_head") + num_kv_heads * (
                lax.axis_index("split") + num_splits * lax.axis_index("seq")
            )

            def run(work, prefetch_q=False):
                """`work` on this program's one item (which copies its own Q tile)."""
                del prefetch_q
                kv_head, split, seq = item_of(index)
                work(kv_head, split, seq, None, jnp.int32(0))

        compute_wgs = config.compute_warpgroups

        @pl.when(wg == compute_wgs)
        @jax.named_scope("copy")
        def _copy():
            if pair:
                plgpu.set_max_registers(40, action="decrease")
            if ordering == "kernel":  # the copy warpgroup orders the slots for compute
                with jax.named_scope("order"):
                    slot_order.order_slots(lens_ref, scratch.lens_smem, scratch.order_smem)
                    plgpu.barrier_arrive(scratch.order_ready)
            run(copy_item)

        for w in range(compute_wgs):

            @pl.when(wg == w)
            @jax.named_scope(f"compute{w}")
            def _compute(w=w):
                if pair:
                    plgpu.set_max_registers(232, action="increase")
                if ordering == "kernel":
                    plgpu.barrier_wait(scratch.order_ready)
                # The first compute warpgroup copies every Q tile; both wait for it.
                run(functools.partial(compute_item, w=w), prefetch_q=w == 0)
                if config.persistent and w == 0:  # one item a program waits in `write_output`
                    plgpu.wait_smem_to_gmem(0)

    return body


def snake_item(k, program, num_programs):
    """The item that `program` takes k-th in a persistent grid: rounds of `num_programs`
    items, dealt forward in even rounds and backward in odd ones, so that with items sorted
    longest first (`longest_first`) every program gets a long and a short one in turn."""
    forward = lax.rem(k, 2) == 0
    return k * num_programs + jnp.where(forward, program, num_programs - 1 - program)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def q_tile_start(kv_head, group):
    """First head of the Q copy of `kv_head`: its group's first head rounded down to a multiple
    of 8, because a TMA copy into tiled shared memory must start on a tile row. The group then
    sits at rows `kv_head * group % 8 ...` of the score tile."""
    return pl.multiple_of(kv_head * group // 8 * 8, 8)


def q_copy_rows(group: int) -> int:
    """Rows of the Q copy: whole 8-row tiles covering the group at any start offset."""
    max_offset = 0 if group % 8 == 0 else 8 - math.gcd(group, 8)
    return _round_up(group + max_offset, 8)
