"""The order in which the decode kernel takes its slots: longest first (`longest_first`).

Which program takes which item changes no number (each item's arithmetic is its own), only
how evenly the programs are loaded: in a ragged batch, items dealt longest first leave no SM
with a long item at the end. Up to `MAX_SLOTS_RANKED` slots, every program ranks them in shared
memory as it starts (`order_slots`); more take one XLA sort of `kv_lens` per call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref

# Batches of up to this many slots (one per thread of a warpgroup) are ranked inside the
# kernel; beyond it the count costs more than XLA's sort (benchmarks/NOTES.md).
MAX_SLOTS_RANKED = 128


def choose(config, items_per_sm: int, num_seq_slots: int) -> str | None:
    """How a call of the decode kernel with `config` orders its slots by length
    (`longest_first`): None (a call of at most one item an SM has no order to choose: one
    program runs per SM, so all its programs start at once), "kernel" (each program counts
    ranks in shared memory, `order_slots`: no extra kernel, but its time grows with the
    square of the slots) or "xla" (one XLA sort kernel, `slots_by_length`, for more than
    `MAX_SLOTS_RANKED`)."""
    if not (config.longest_first and items_per_sm > 1):
        return None
    return "kernel" if num_seq_slots <= MAX_SLOTS_RANKED else "xla"


def slots_by_length(kv_lens: jax.Array) -> jax.Array:
    """Slot ids in order of increasing kv_len: one XLA sort kernel and nothing else (the
    slot ids sorted along are a constant; the kernel walks the order from its end)."""
    slots = jnp.asarray(np.arange(kv_lens.shape[0], dtype=np.int32))
    return lax.sort((kv_lens, slots), num_keys=1)[1]


def order_slots(lens_ref, lens_smem, order_smem):
    """Ranks the slots by kv_len, longest first (ties: lower slot first), in the calling
    warpgroup: `lens_smem` gets the lengths and `order_smem[r]` the slot of rank r.

    A count in shared memory instead of an XLA sort kernel before the call: each thread takes
    slots `t, t + 128, ...` and counts the slots that rank before them. Pallas Mosaic GPU has
    no per-thread loops or scatter stores, so this is written against Mosaic GPU directly."""
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
