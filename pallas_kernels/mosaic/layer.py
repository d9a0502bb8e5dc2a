"""A decoder layer's work after attention as one persistent Mosaic GPU kernel (Hopper), for
decode steps of at most 8 rows (issue 20; benchmarks/NOTES.md, sessions 45-46).

At B=1 the `1b` decode step spends ~40.5 us a layer in eight kernels after the decode kernel
(runs 176, 209): the split merge, o, `add_rms_norm`, gate/up, SwiGLU, down, `add_rms_norm` and
the next layer's qkv. Each pays a ramp and a tail. This kernel runs them as phases of one
launch, one program per SM; its weight tiles ([128, 64], TMA) come through one pipeline
across all four phases, so the next phase's copies are in flight while a program waits at a
grid barrier:

  - o's programs merge the decode kernel's unmerged split states of their heads (or take a
    merged attention output); phase o: attn [R, Hq*D] @ Wo as float32 partial sums over
    parts of K;
  - barrier; each program sums them with the residual x (h = x + o, as `add_rms_norm` does)
    and writes the RMSNorm of h into shared memory as the next phase's x; program 0 keeps h;
  - phase gate/up: normed @ [gate | up], float32 partial sums over parts of K;
  - barrier; each program with a down unit takes SwiGLU of its part of the intermediate
    dimension (the partial sums added, `silu(gate) * up` rounded once, as `models.decoder.MLP`
    does for small steps);
  - phase down: act @ Wd, partial sums over parts of K;
  - barrier; each program takes h2 = h + down and the next layer's input norm of it; program
    0 writes h2, the kernel's first output;
  - phase qkv: normed @ Wqkv (the next layer's), float32 partial sums, the kernel's second
    output (the Mosaic decode kernel's fold sums such parts). The last layer has no qkv: after
    down a last barrier, and program 0 writes h2 and the final norm.

Work is split into units (a 64-column tile and a part of K), dealt round-robin to the programs
(`Schedule`). The weights come either as the model's own matrices, read where they lie by a
copy warpgroup ("direct", what the model path runs), or as a copy in the order the units read
them (`probes.layer_kernel.arrange`, streamed by `emit_pipeline` in one warpgroup). The
barriers count in a ref that outlives the call (`grid_barrier`), so no memset precedes it.

Session 48 measured the barriers as dear as the kernel boundaries they replace (each program
arrives with its partial sums stored, waits for the slowest, and takes the next prologue with
its weight stages full). `post_attention_phases` runs the same phases as one kernel each
(`layer(..., only=j)`): a kernel boundary where the barrier was, and each prologue first
thing in its kernel, beside the first weight copies, which do not depend on it. Seven XLA
kernels after attention become four, with no barrier, counter or memset.

`probes.layer_kernel` measures both forms and runs `Schedule` in NumPy (`simulate`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, scf, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import device_num_sms
from pallas_kernels.mosaic.add_rms_norm import add_rms_norm, inverse_rms
from pallas_kernels.mosaic.common import SMEM_LIMIT, launch
from pallas_kernels.mosaic.merge import merge_values
from pallas_kernels.mosaic.pipeline import TILED, tiled_indices

TILE_N, TILE_K = 64, 128
PHASE_NAMES = ("o", "gate_up", "down", "qkv")  # the layer's phases, in order
# What each phase's kernel of its own reads of the earlier ones' outputs (`layer`'s `carried`):
# gate/up's norm o's partial sums, down's SwiGLU gate/up's, qkv's norm h and down's.
CARRIED = ((), ("o",), ("gu",), ("h", "d"))
ROWS = 8  # the padded rows: x is `wgmma`'s N
RUN = 4  # columns a thread takes at once in the per-thread code
THREADS = 128


def select(values, index):
    """values[index] for a static list (of ints or traced int32 scalars) and a traced index
    (Mosaic GPU indexes no constants)."""
    out = jnp.asarray(values[0], jnp.int32)
    for j, v in enumerate(values[1:], 1):
        out = jnp.where(index == j, jnp.asarray(v, jnp.int32), out)
    return out


# Polls before a barrier gives up (each an L2 round trip: a fraction of a second in all): a
# wrong barrier then shows as a count in `counters[2]` instead of a kernel that never ends.
MAX_POLLS = 1 << 20


def grid_barrier(
    counters,
    parity: int,
    barrier: int,
    num_programs: int,
    *,
    trap: bool = False,
    release: bool = True,
):
    """The warpgroups of all `num_programs` programs meet at `counters[parity, barrier]`: one
    thread's release add of 1 at GPU scope, then its acquire poll until the count reaches
    `num_programs`, as `plgpu.semaphore_signal` / `semaphore_wait` do on their own
    semaphores, on a plain int32 ref that outlives the call ([3, barriers]). After
    `MAX_POLLS` polls (a program not resident, or a wrong barrier) the program adds 1 to
    `counters[2, barrier]`, which a caller reads to know that the barrier failed, and goes
    on, or with `trap` aborts the kernel (the call fails with a CUDA error, not with wrong
    numbers: what the model path needs, which reads no counts)."""
    width = counters.shape[1]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def meet(ctx, counters_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        base = mgpu_utils.memref_ptr(counters_ref)
        ptr = mgpu_utils.getelementptr(base, [parity * width + barrier], i32)
        failed = mgpu_utils.getelementptr(base, [2 * width + barrier], i32)
        mgpu_utils.warpgroup_barrier()  # every thread's stores before the one thread's release
        # `release` False, a diagnostic: the program's stores not ordered before its arrival
        mgpu_utils.SemaphoreRef(ptr).signal(1, relaxed=not release, memory_scope="gpu")
        with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
            loop = scf.WhileOp([i32, i32], [mgpu_utils.c(0, i32), mgpu_utils.c(0, i32)])
            before = loop.before.blocks.append(i32, i32)
            with ir.InsertionPoint(before):
                polls, _ = before.arguments
                count = mgpu_utils.inline_ptx(
                    "ld.relaxed.gpu.global.b32 $0, [$1];",
                    ptr,
                    result_types=i32,
                    has_side_effects=True,
                )
                short = arith.cmpi(arith.CmpIPredicate.ult, count, mgpu_utils.c(num_programs, i32))
                more = arith.cmpi(arith.CmpIPredicate.ult, polls, mgpu_utils.c(MAX_POLLS, i32))
                polls = arith.addi(polls, mgpu_utils.c(1, i32))
                scf.condition(arith.andi(short, more), [polls, count])
            after = loop.after.blocks.append(i32, i32)
            with ir.InsertionPoint(after):
                scf.yield_(after.arguments)
            _, count = loop.results
            gave_up = arith.cmpi(arith.CmpIPredicate.ult, count, mgpu_utils.c(num_programs, i32))
            with mgpu_utils.when(gave_up):
                mgpu_utils.inline_ptx(
                    "red.relaxed.gpu.global.add.u32 [$0], 1;", failed, has_side_effects=True
                )
                if trap:
                    mgpu_utils.inline_ptx("trap;", has_side_effects=True)
            mgpu_utils.inline_ptx("fence.acquire.gpu;", has_side_effects=True)
        mgpu_utils.warpgroup_barrier()

    meet(counters)


@plgpu.inline_mgpu()
def proxy_fence(ctx):
    """Orders this thread's TMA (async proxy) accesses of global memory against its ordinary
    ones: stores complete before a barrier's arrival, loads after its release."""
    del ctx
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    heads_dim: int = 2048  # Hq * D, o's K
    inter: int = 6144
    qkv: int = 4096  # (Hq + 2 Hkv) * D
    head_dim: int = 128  # D


@dataclasses.dataclass(frozen=True)
class Phase:
    """One projection: K, its output columns (for a `pair` phase the columns of gate alone;
    `direct`'s gate/up has the fused matrix's 2 I), the parts of K its units take, and
    whether a unit is a gate tile and its up tile (`arrange`'s gate/up)."""

    k: int
    cols: int
    parts: int
    pair: bool = False

    @property
    def units(self) -> int:
        return self.cols // TILE_N * self.parts

    @property
    def steps(self) -> int:  # weight tiles a unit reads
        return self.k // TILE_K // self.parts * (2 if self.pair else 1)


def phases(
    shape: Shape,
    direct: bool = False,
    num_programs: int = 132,
    last: bool = False,
    qkv_only: bool = False,
) -> tuple[Phase, ...]:
    """o, gate/up, down and, unless `last`, qkv; with `qkv_only` (`norm_qkv`) qkv alone.
    `arrange`'s form is the `1b` shape's: gate/up's units a gate tile and its up tile over a
    quarter of K. `direct`: 64 columns of each of the model's matrices (the fused gate/up
    [hidden, 2 I] in its interleaved columns, `models.decoder.split_gate_up`), each phase's
    parts of K from `choose_parts`."""
    qkv = Phase(shape.hidden, shape.qkv, choose_parts(shape.hidden, shape.qkv, num_programs))
    if qkv_only:
        assert direct and not last
        return (qkv,)
    if not direct:
        assert not last
        return (
            Phase(shape.heads_dim, shape.hidden, 4),
            Phase(shape.hidden, shape.inter, 4, pair=True),
            Phase(shape.inter, shape.hidden, 4),
            Phase(shape.hidden, shape.qkv, 2),
        )
    heads = shape.heads_dim // shape.head_dim

    # o's parts are whole heads that one warpgroup merges (4 elements a thread). A program's
    # o units, and its down units, must share their part of K, the part its prologue merges
    # or takes SwiGLU of (`Schedule` deals part q to programs q mod parts, so P a multiple of
    # the parts, or one unit a program, does).
    def shared(d, cols):
        return num_programs % d == 0 or cols // TILE_N * d <= num_programs

    o_parts = choose_parts(
        shape.heads_dim,
        shape.hidden,
        num_programs,
        ok=lambda d: (
            heads % d == 0 and shape.heads_dim // d <= THREADS * RUN and shared(d, shape.hidden)
        ),
    )
    down_parts = choose_parts(
        shape.inter, shape.hidden, num_programs, ok=lambda d: num_programs % d == 0
    )
    layers = [
        Phase(shape.heads_dim, shape.hidden, o_parts),
        Phase(
            shape.hidden, 2 * shape.inter, choose_parts(shape.hidden, 2 * shape.inter, num_programs)
        ),
        Phase(shape.inter, shape.hidden, down_parts),
    ]
    if not last:
        layers.append(qkv)
    return tuple(layers)


def choose_parts(k: int, cols: int, num_programs: int, ok=lambda d: True) -> int:
    """The parts of K for a phase of `cols` output columns: the divisor d of its K steps that
    gives the fewest tiles to the busiest program (ceil(units / P) * steps), the fewest parts
    among equals (fewer partial sums to add), among those `ok` allows."""
    k_steps = k // TILE_K
    tiles = cols // TILE_N
    options = [d for d in range(1, k_steps + 1) if k_steps % d == 0 and ok(d)]
    if not options:
        raise ValueError(f"no part count of K={k} fits ({cols} columns, {num_programs} programs)")
    return min(options, key=lambda d: (-(-tiles * d // num_programs) * (k_steps // d), d))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which program runs which unit, in which order, and what each of its iterations reads
    and writes. Unit u of phase j runs on program (u + offsets[j]) % P: gate/up's first units
    go to the programs that o leaves idle (at `1b`, the 4 that o, down and qkv with 128
    units each leave idle). Pure `jnp`, so that the kernel computes it on its scalars and
    `simulate` on arrays of them."""

    shape: Shape
    num_programs: int
    direct: bool = False
    last: bool = False
    qkv_only: bool = False
    only: int | None = None  # one phase of the layer (0-3) as a kernel of its own

    @property
    def phases(self) -> tuple[Phase, ...]:
        ps = phases(self.shape, self.direct, self.num_programs, self.last, self.qkv_only)
        return ps if self.only is None else (ps[self.only],)

    @property
    def first(self) -> int:
        """The layer's phase (o 0, gate/up 1, down 2, qkv 3) that the schedule starts with."""
        return 3 if self.qkv_only else self.only or 0

    def local(self, phase: int) -> int | None:
        """The schedule's index of the layer's phase `phase`, None where it runs none."""
        j = phase - self.first
        return j if 0 <= j < len(self.phases) else None

    @property
    def offsets(self) -> tuple[int, ...]:
        """Gate/up starts on the programs after o's units (the ones o leaves idle) where both
        run in one kernel; the other phases on program 0, so that down's part q stays on
        programs q mod its parts."""
        if self.first != 0 or len(self.phases) == 1:
            return (0,) * len(self.phases)
        return (0, self.phases[0].units % self.num_programs, 0, 0)[: len(self.phases)]

    @property
    def bases(self) -> list[int]:  # each phase's first tile in `arrange`'s array
        return list(itertools.accumulate([0] + [p.units * p.steps for p in self.phases]))

    @property
    def max_count(self) -> int:
        """Iterations of the pipeline: the most any program runs, plus one, so that every
        program passes every barrier inside the loop."""
        return sum(-(-p.units // self.num_programs) * p.steps for p in self.phases) + 1

    def plan(self, program):
        """([first unit, units] per phase, each phase's first iteration, then the count)."""
        num = self.num_programs
        info = []
        for j, p in enumerate(self.phases):
            first = (program - self.offsets[j] + num) % num
            count = jnp.maximum((p.units - first + num - 1) // num, 0)
            info.append((first, jnp.where(first < p.units, count, 0)))
        local = [jnp.zeros_like(program)]
        for (_, n), p in zip(info, self.phases, strict=True):
            local.append(local[-1] + n * p.steps)
        return info, local

    def locate(self, i, info, local):
        """For iteration i (clamped to the program's last): its phase, unit, step, the unit's
        part and column tile, the weight tile it reads (a row block of `arrange`'s array, or
        rows `w_k_step` of the phase's own matrix), the 128 columns of the phase's x it
        multiplies (`k_step`), and whether it ends a product (a unit, or a gate/up unit's
        gate half)."""
        ps = self.phases
        count = local[-1]
        i = jnp.clip(i, 0, jnp.maximum(count - 1, 0))
        phase, t = jnp.zeros_like(i), i
        for j in range(1, len(ps)):
            inside = i >= local[j]
            phase = jnp.where(inside, j, phase)
            t = jnp.where(inside, i - local[j], t)
        steps = select([p.steps for p in ps], phase)
        parts = select([p.parts for p in ps], phase)
        half = select([p.steps // 2 if p.pair else p.steps for p in ps], phase)
        first = select([f for f, _ in info], phase)
        unit = first + (t // steps) * self.num_programs
        step = t % steps
        part, tile = unit % parts, unit // parts
        # x holds all of K, except in down, where it holds the program's part of act.
        w_k_step = part * half + step % half
        down = self.local(2)
        k_step = w_k_step if down is None else jnp.where(phase == down, step, w_k_step)
        return dict(
            phase=phase,
            unit=unit,
            step=step,
            part=part,
            tile=tile,
            which=(step >= half).astype(jnp.int32),
            k_step=k_step,
            w_k_step=w_k_step,
            tile_row=select(self.bases, phase) + unit * steps + step,
            ends=(step == half - 1) | (step == steps - 1),
        )


def _row_norm(
    parts, resid, scale, sum_out, normed_out, warp_sums, row, *, eps, write_sum, smem=True
):
    """Per-thread code of the compute warpgroup for one row: h = resid + rounded(sum of the
    partial sums), rounded, as `jaxpaged.add_rms_norm` (`parts` None: h = resid); its RMSNorm
    times `scale` rounded to bfloat16 into row `row` of `normed_out`: the next phase's x in
    shared memory (`TILED`), or with `smem` False a GMEM ref (the last layer's output); h into
    `sum_out` (unless None) where `write_sum`. Runs of 4 columns a thread; runs past the row's
    end load the last run again and store nothing."""
    has_parts, has_sum = parts is not None, sum_out is not None

    def kernel(ctx, *args):
        del ctx
        args = list(args)
        parts = args.pop(0) if has_parts else None
        resid, scale = args.pop(0), args.pop(0)
        sum_out = args.pop(0) if has_sum else None
        normed_out, warp_sums, row, write_sum = args
        num_parts = ir.MemRefType(parts.type).shape[0] if has_parts else 0
        hidden = ir.MemRefType(resid.type).shape[1]
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        bf16 = ir.BF16Type.get()
        vec = lambda t: ir.VectorType.get([RUN], t)  # noqa: E731
        c32 = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
        r = arith.index_cast(index, row.registers.item())

        def rounded(v):
            return arith.extf(vec(f32), arith.truncf(vec(bf16), v))

        tid = arith.remui(mgpu_utils.thread_idx(), c32(THREADS))
        runs, loaded = [], []
        for k in range(-(-hidden // (RUN * THREADS))):
            col = arith.muli(arith.addi(tid, c32(k * THREADS)), c32(RUN))
            valid = arith.cmpi(arith.CmpIPredicate.ult, col, c32(hidden))
            col = arith.index_cast(index, arith.minui(col, c32(hidden - RUN)))
            terms = [
                vector.load(vec(f32), parts, [mgpu_utils.c(s, index), r, col])
                for s in range(num_parts)
            ]
            x_run = arith.extf(vec(f32), vector.load(vec(bf16), resid, [r, col]))
            s_run = arith.extf(vec(f32), vector.load(vec(bf16), scale, [col]))
            runs.append((valid, col))
            loaded.append((x_run, terms, s_run))
        totals, squares = [], None
        zero = vector.broadcast(vec(f32), mgpu_utils.c(0.0, f32))
        for (valid, _), (x_run, terms, _) in zip(runs, loaded, strict=True):
            if terms:
                h_run = terms[0]
                for term in terms[1:]:
                    h_run = arith.addf(h_run, term)
                total = rounded(arith.addf(x_run, rounded(h_run)))
            else:
                total = x_run
            totals.append(total)
            square = arith.select(valid, arith.mulf(total, total), zero)
            squares = square if squares is None else arith.addf(squares, square)
        barrier = mgpu_utils.warpgroup_barrier
        inv = inverse_rms(squares, warp_sums, tid, hidden=hidden, eps=eps, barrier=barrier)
        inv = vector.broadcast(vec(f32), inv)
        barrier()  # warp_sums is read before the next row writes it
        store_sum = arith.cmpi(arith.CmpIPredicate.ne, write_sum.registers.item(), c32(0))
        for (valid, col), (_, _, s_run), total in zip(runs, loaded, totals, strict=True):
            normed = arith.truncf(vec(bf16), arith.mulf(total, arith.mulf(inv, s_run)))
            with mgpu_utils.when(valid):
                if smem:
                    vector.store(normed, normed_out, tiled_indices(r, col))
                else:
                    vector.store(normed, normed_out, [r, col])
            if has_sum:
                with mgpu_utils.when(arith.andi(valid, store_sum)):
                    vector.store(arith.truncf(vec(bf16), total), sum_out, [r, col])

    refs = [ref for ref in (parts, resid, scale, sum_out) if ref is not None]
    out_type = plgpu.RefType(TILED) if smem else plgpu.RefType()
    splat = plgpu.Layout.WG_SPLAT(shape=())
    arg_types = (*(plgpu.RefType(),) * len(refs), out_type, plgpu.RefType(), splat, splat)
    plgpu.inline_mgpu(arg_types=arg_types)(kernel)(*refs, normed_out, warp_sums, row, write_sum)


def _row_swiglu(gate_up, x_smem, row, part, *, width, pairs):
    """Per-thread code for one row: SwiGLU of columns [part * width, (part + 1) * width) of the
    intermediate dimension, gate and up each the sum of their partial sums, rounded to
    bfloat16 into `x_smem` columns [0, width). `gate_up`: f32[S, R, 2, I] (gate, then up), or
    with `pairs` the model's fused columns f32[S, R, 2 I] (gate j at 2 j, up j at 2 j + 1),
    of which a thread loads 8 adjacent ones for its 4."""

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(TILED),
            plgpu.Layout.WG_SPLAT(shape=()),
            plgpu.Layout.WG_SPLAT(shape=()),
        )
    )
    def rows(ctx, gate_up, x_smem, row, part):
        del ctx
        num_parts = ir.MemRefType(gate_up.type).shape[0]
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        bf16 = ir.BF16Type.get()
        vec, wide = ir.VectorType.get([RUN], f32), ir.VectorType.get([2 * RUN], f32)
        c32 = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
        r = arith.index_cast(index, row.registers.item())
        base = arith.muli(part.registers.item(), c32(width))
        tid = arith.remui(mgpu_utils.thread_idx(), c32(THREADS))

        def summed(load):
            total = load(0)
            for s in range(1, num_parts):
                total = arith.addf(total, load(s))
            return total

        runs = []
        for k in range(-(-width // (RUN * THREADS))):
            local = arith.muli(arith.addi(tid, c32(k * THREADS)), c32(RUN))
            valid = arith.cmpi(arith.CmpIPredicate.ult, local, c32(width))
            local = arith.minui(local, c32(width - RUN))
            col = arith.addi(base, local)
            if pairs:
                col = arith.index_cast(index, arith.muli(col, c32(2)))
                total = summed(
                    lambda s, col=col: vector.load(wide, gate_up, [mgpu_utils.c(s, index), r, col])
                )
                gate = vector.shuffle(total, total, [0, 2, 4, 6])
                up = vector.shuffle(total, total, [1, 3, 5, 7])
            else:
                col = arith.index_cast(index, col)
                gate, up = (
                    summed(
                        lambda s, col=col, which=which: vector.load(
                            vec,
                            gate_up,
                            [mgpu_utils.c(s, index), r, mgpu_utils.c(which, index), col],
                        )
                    )
                    for which in range(2)
                )
            runs.append((valid, local, gate, up))
        one = vector.broadcast(vec, mgpu_utils.c(1.0, f32))
        for valid, local, gate, up in runs:
            sig = arith.divf(one, arith.addf(one, mlir_math.exp(arith.negf(gate))))
            act = arith.truncf(
                ir.VectorType.get([RUN], bf16), arith.mulf(arith.mulf(gate, sig), up)
            )
            with mgpu_utils.when(valid):
                vector.store(act, x_smem, tiled_indices(r, arith.index_cast(index, local)))

    rows(gate_up, x_smem, row, part)


def _row_merge(outs, lses, x_smem, row, part, *, heads_per_part):
    """Per-thread code for one row: the split-KV merge of the `heads_per_part` heads of o's K
    part `part` (`pallas_kernels.mosaic.merge.merge_values`), from the decode kernel's
    unmerged states (`outs` f32[R, splits, Hq, D], or bfloat16 for one split; `lses`
    f32[R, splits, Hq]), rounded to bfloat16 into `x_smem` columns [part * heads_per_part *
    D, ...). A thread takes 4 elements of one head; threads past the part's heads take
    none."""

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(TILED),
            plgpu.Layout.WG_SPLAT(shape=()),
            plgpu.Layout.WG_SPLAT(shape=()),
        )
    )
    def rows(ctx, outs, lses, x_smem, row, part):
        del ctx
        _, num_splits, _, head_dim = ir.MemRefType(outs.type).shape
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        c32 = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
        r = arith.index_cast(index, row.registers.item())
        tid = arith.remui(mgpu_utils.thread_idx(), c32(THREADS))
        threads_per_head = head_dim // RUN
        active = heads_per_part * threads_per_head
        takes = arith.cmpi(arith.CmpIPredicate.ult, tid, c32(active))
        tid = arith.minui(tid, c32(active - 1))
        local_head = arith.divui(tid, c32(threads_per_head))
        head = arith.addi(arith.muli(part.registers.item(), c32(heads_per_part)), local_head)
        col = arith.muli(arith.remui(tid, c32(threads_per_head)), c32(RUN))
        head_i, col_i = arith.index_cast(index, head), arith.index_cast(index, col)
        splits = [mgpu_utils.c(s, index) for s in range(num_splits)]
        split_lses = [memref.load(lses, [r, s, head_i]) for s in splits]
        out_type = ir.MemRefType(outs.type).element_type  # float32; q's dtype for one split
        values = [
            vector.load(ir.VectorType.get([RUN], out_type), outs, [r, s, head_i, col_i])
            for s in splits
        ]
        if out_type != f32:
            values = [arith.extf(ir.VectorType.get([RUN], f32), v) for v in values]
        merged, _ = merge_values(split_lses, values)
        merged = arith.truncf(ir.VectorType.get([RUN], ir.BF16Type.get()), merged)
        x_col = arith.addi(arith.muli(head, c32(head_dim)), col)
        with mgpu_utils.when(takes):
            vector.store(merged, x_smem, tiled_indices(r, arith.index_cast(index, x_col)))

    rows(outs, lses, x_smem, row, part)


def _store_transposed(acc, y_smem):
    """y_smem [R, 64] = acc.T for a float32 `wgmma` accumulator [64, R]: per-thread scalar
    stores (4 a thread at R = 8), since Pallas' transposed store of it fails Mosaic GPU's
    layout inference (the bfloat16 one, which `layer_stream` uses, does not)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, acc, y_smem):
        del ctx
        acc.foreach(lambda value, idx: memref.store(value, y_smem, [idx[1], idx[0]]))

    store(acc, y_smem)


def _store_partial(acc, dest, part, col, rows):
    """dest[part, :rows, col:col + 64] = acc.T[:rows] for a float32 `wgmma` accumulator
    [64, 8], straight from each thread's registers into GMEM (no shared memory, no TMA): the
    stores are ordinary ones, which a grid barrier's release orders before its arrival."""

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.Layout.WGMMA,
            plgpu.RefType(),
            plgpu.Layout.WG_SPLAT(shape=()),
            plgpu.Layout.WG_SPLAT(shape=()),
        )
    )
    def store(ctx, acc, dest, part, col):
        del ctx
        index = ir.IndexType.get()
        p = arith.index_cast(index, part.registers.item())
        c0 = arith.index_cast(index, col.registers.item())

        def one(value, idx):
            column, row = idx
            at = [p, row, arith.addi(c0, column)]
            if rows == ROWS:
                memref.store(value, dest, at)
            else:
                short = arith.cmpi(arith.CmpIPredicate.ult, row, mgpu_utils.c(rows, index))
                with mgpu_utils.when(short):
                    memref.store(value, dest, at)

        acc.foreach(one)

    store(acc, dest, part, col)


def _row_zero(out, row):
    """Per-thread code: row `row` of the GMEM ref `out` [R, hidden] set to zeros."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))
    def zero(ctx, out, row):
        del ctx
        _, hidden = ir.MemRefType(out.type).shape
        dtype = ir.MemRefType(out.type).element_type
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        c32 = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
        r = arith.index_cast(index, row.registers.item())
        tid = arith.remui(mgpu_utils.thread_idx(), c32(THREADS))
        zeros = vector.broadcast(ir.VectorType.get([RUN], dtype), mgpu_utils.c(0.0, dtype))
        for k in range(-(-hidden // (RUN * THREADS))):
            col = arith.muli(arith.addi(tid, c32(k * THREADS)), c32(RUN))
            with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, col, c32(hidden))):
                vector.store(zeros, out, [r, arith.index_cast(index, col)])

    zero(out, row)


def layer(
    attn,
    x,
    w,
    scale_mlp,
    scale_next,
    counters,
    *,
    parity,
    eps,
    kv_lens=None,
    stages=4,
    only=None,
    carried=None,
    prefetch_next=None,
    prologues=True,
    barriers=True,
    stores="wait",
    partials="regs",
    early_free=True,
    trap=False,
    profile_dir=None,
    shape=Shape(),
):
    """One layer after attention, for R <= 8 rows (`ROWS`).

    Args:
      attn: the attention output [8, Hq*D] bfloat16 (rows past R zero), or the decode
        kernel's unmerged states, (outputs f32[S, splits, Hq, D] or, for one split, bfloat16
        [S, 1, Hq, D]; LSEs f32[S, splits, Hq]) with S >= R, which o's programs merge
        themselves (`pallas_kernels.mosaic.paged_decode`'s `merge=False`).
      x: [R, hidden] bfloat16, the residual stream.
      w: the model's own matrices ("direct": wo [Hq*D, hidden], the fused gate/up [hidden,
        2 I] in `models.decoder.fuse_gate_up`'s columns, wd [I, hidden] and the next layer's
        wqkv [hidden, qkv]), read where they lie by a copy warpgroup beside the compute
        warpgroup; the last layer passes (wo, gate/up, wd); `norm_qkv` (wqkv,) alone, with
        attn, scale_mlp and counters None: x's norm (scale_next) and qkv. Or one array from
        `probes.layer_kernel.arrange`, streamed by `emit_pipeline` in one warpgroup.
      scale_mlp, scale_next: the post-attention norm's scale [hidden], and the next layer's
        input norm's (the last layer: the final norm's).
      counters: a `jax.new_ref` of [3, 3] int32 zeros, shared by consecutive calls that take
        `parity` 0 and 1 in turn (`grid_barrier`); row 2 counts barriers given up.
      eps: the norms' epsilon.
      kv_lens: i32[S >= R], the decode step's: rows of inactive slots (kv_len 0) skip the
        merge, the norms and SwiGLU (at B=1 the step's second row is padding); their h2 and
        qkv are undefined, their final norm zero. None: every row is live.
      only: one phase of the layer (o 0, gate/up 1, down 2, qkv 3) as a kernel of its own,
        its prologue first where the persistent kernel has a grid barrier
        (`post_attention_phases`): `w` (that phase's matrix,), `counters` None, `carried`
        the earlier phases' outputs that its prologue reads (gate/up {"o"}, down {"gu"},
        qkv {"h", "d"}); attn is read by o's kernel alone, x by gate/up's.
      prefetch_next: with `only` below 3, the next phase's matrix: after its last copy, each
        program's copy warpgroup asks the L2 for the first `stages` weight tiles that the
        same program reads in the next phase's kernel (TMA prefetches, nothing waits for
        them), so that kernel's pipeline fills from the L2 (a probe option, session 52).
      trap: a grid barrier that gives up aborts the kernel (`grid_barrier`) instead of
        counting in `counters[2]` and going on.

    Returns:
      h2 [R, hidden] (the residual after the MLP) and the next layer's qkv as float32 partial
      sums [parts, R, qkv]; the last layer h2 and its final norm [R, hidden]; `norm_qkv`'s
      form the qkv partial sums alone. With `only`, the phase's outputs by name: o {"o"},
      gate/up {"h", "gu"}, down {"d"}, qkv {"h2", "qkv"} (the partial sums float32 [parts,
      R, cols]; h = x + o and h2 = h + down [R, hidden]).

    Diagnostics: without `prologues` the programs skip the merge, the norms and SwiGLU, and
    without `barriers` the grid barriers too (wrong numbers both, what they cost); `stores`
    "nowait" arrives at a barrier without waiting for the program's stores to complete,
    "unordered" arrives by a relaxed add (the stores not ordered before it), and "none"
    stores no partial sums (wrong numbers, what the stores cost at a barrier).
    `partials` "regs" stores the float32 partial sums from the registers ("direct" weights;
    "tma": through shared memory and a TMA store), and `early_free` frees a weight tile's
    slot before a product's store ("direct"), not after it (session 49);
    `profile_dir` traces each program's "kernel", "barrier{b}" and "prologue{j}" regions
    (Mosaic GPU's in-kernel profiler, `probes.layer_stream.barrier_trace` reads them)."""
    assert stores in ("wait", "nowait", "unordered", "none") and partials in ("regs", "tma")
    direct = isinstance(w, tuple)
    partials = partials if direct else "tma"  # `arrange`'s gate/up stores halves
    split = only is not None
    assert not split or (direct and len(w) == 1 and counters is None and only in range(4))
    last = direct and not split and len(w) == 3
    qkv_only = direct and not split and len(w) == 1  # `norm_qkv`
    carried = dict(carried or {})
    rows = x.shape[0]  # R
    assert 1 <= rows <= ROWS and x.shape == (rows, shape.hidden)
    num_programs = device_num_sms()
    sched = Schedule(shape, num_programs, direct, last, qkv_only, only)
    ps, first = sched.phases, sched.first
    states = attn if first == 0 and isinstance(attn, tuple) else ()
    takes_attn = first == 0 and not states  # a merged attention output, copied in
    if states:  # o's programs merge them into x_smem's first R rows
        assert states[0].shape[2:] == (shape.heads_dim // shape.head_dim, shape.head_dim)
        assert states[0].shape[0] >= rows and states[1].shape == states[0].shape[:3]
    elif takes_attn:
        assert attn.shape == (ROWS, shape.heads_dim)
    down = sched.local(2)
    # x's shared memory holds one part of the intermediate dimension in the down phase: a
    # program's down units share it (`choose_parts`; at `1b` one unit a program).
    if direct and down is not None:
        assert num_programs % ps[down].parts == 0
    elif not direct:
        assert ps[2].units <= num_programs and min(p.units for p in ps) >= num_programs - 4
    if first == 0:  # o's merge: one warpgroup a part
        assert shape.heads_dim // ps[0].parts <= THREADS * RUN
    assert kv_lens is None or (kv_lens.dtype == jnp.int32 and kv_lens.shape[0] >= rows)
    heads = shape.heads_dim // shape.head_dim
    f32 = jnp.float32
    width = 0 if down is None else shape.inter // ps[down].parts
    x_cols = _x_cols(shape, sched)
    assert _smem_bytes(x_cols, stages if direct else 0) <= SMEM_LIMIT
    weights = w if direct else (w,)

    # The kernel's inputs and outputs by name: what the phases' prologues read and their
    # products write. The persistent kernel writes every intermediate (o, gu, d and h: its
    # programs read them back after the barriers); a phase of its own reads the earlier
    # phases' from `carried` and writes its own.
    ins = {}
    if takes_attn:
        ins["attn"] = attn
    if qkv_only:
        ins["h"] = x  # the residual stream whose norm qkv takes
    elif not split or only == 1:
        ins["x"] = x
    if not split or only == 1:
        ins["scale_mlp"] = scale_mlp
    if not split or only == 3 or qkv_only:
        ins["scale_next"] = scale_next
    if counters is not None:
        ins["counters"] = counters
    if kv_lens is not None:
        ins["kv_lens"] = kv_lens
    ins.update({f"w{j}": m for j, m in enumerate(weights)})
    if prefetch_next is not None:
        assert split and only < 3 and prefetch_next.dtype == weights[0].dtype
        ins["w_next"] = prefetch_next
    if states:
        ins.update(zip(("state_out", "state_lse"), states, strict=True))
    needs = () if only is None else CARRIED[only]
    if set(carried) != set(needs):
        raise ValueError(f"phase {only} takes carried {sorted(needs)}; got {sorted(carried)}")
    ins.update((name, carried[name]) for name in needs)

    def partial_sums(j):
        p = ps[sched.local(j)]
        cols = {0: shape.hidden, 2: shape.hidden, 3: shape.qkv}.get(j)
        if j == 1:
            gu = (rows, 2 * shape.inter) if direct else (rows, 2, shape.inter)
            return jax.ShapeDtypeStruct((p.parts, *gu), f32)
        return jax.ShapeDtypeStruct((p.parts, rows, cols), f32)

    residual = jax.ShapeDtypeStruct((rows, shape.hidden), x.dtype)
    if qkv_only:
        outs = {"qkv": partial_sums(3)}
    elif split:  # the phase's partial sums, after h (gate/up) or h2 (qkv), its prologue's
        name = ("o", "gu", "d", "qkv")[only]
        outs = {"h": residual} if only == 1 else {"h2": residual} if only == 3 else {}
        outs[name] = partial_sums(only)
    else:
        outs = {"h2": residual, **({"final": residual} if last else {"qkv": partial_sums(3)})}
        outs.update(o=partial_sums(0), gu=partial_sums(1), d=partial_sums(2), h=residual)
    names = (*ins, *outs)

    def body(*refs):
        named = dict(zip(names, refs[: len(names)], strict=True))
        scratch = refs[len(names) :]
        get = named.get
        attn_ref, x_ref, counters_ref, lens_ref = (
            get(n) for n in ("attn", "x", "counters", "kv_lens")
        )
        s_mlp_ref, s_next_ref = get("scale_mlp"), get("scale_next")
        w_refs = [named[f"w{j}"] for j in range(len(weights))]
        state_refs = [named[n] for n in ("state_out", "state_lse") if n in named]
        o_ref, gu_ref, d_ref, h_ref, h2_ref = (get(n) for n in ("o", "gu", "d", "h", "h2"))
        qkv_ref = get("qkv", get("final"))  # the last layer: its final norm
        x_smem, y_smem, warp_sums, a_barrier, pipe = scratch
        program = lax.axis_index("program")
        info, local = sched.plan(program)
        count = local[-1]

        def when_live(r):
            """Runs a row's per-thread code where its slot is active (`kv_lens`)."""
            if lens_ref is None:
                return lambda fn: fn()
            return pl.when(lens_ref[r] > 0)

        def norm_rows(parts, resid, scale, sum_out, out, write_sum, smem=True):
            """`_row_norm` of each live row: h = resid (+ parts), its norm into `out`."""
            for r in range(rows):
                when_live(r)(
                    functools.partial(
                        _row_norm,
                        parts,
                        resid,
                        scale,
                        sum_out,
                        out,
                        warp_sums,
                        jnp.int32(r),
                        eps=eps,
                        write_sum=write_sum,
                        smem=smem,
                    )
                )

        def prologue(j):
            """What a program does before the layer's phase j's first product (j > 0): after
            barrier j - 1, or first thing in a kernel of the phase's own."""
            if not prologues:
                return
            if j == 1 or j == 3:
                scale = s_mlp_ref if j == 1 else s_next_ref
                parts, resid = (o_ref, x_ref) if j == 1 else (d_ref, h_ref)
                out = h_ref if j == 1 else h2_ref
                norm_rows(parts, resid, scale, out, x_smem, (program == 0).astype(jnp.int32))
            else:
                unit, n = info[down]

                @pl.when(n > 0)
                def _():
                    for r in range(rows):
                        when_live(r)(
                            functools.partial(
                                _row_swiglu,
                                gu_ref,
                                x_smem,
                                jnp.int32(r),
                                lax.rem(unit, ps[down].parts),
                                width=width,
                                pairs=direct,
                            )
                        )

            plgpu.commit_smem()

        def step(i, w_tile, acc, wait_tile=None, free_tile=None):
            """Iteration i: its barriers and prologues first, then its product with the
            weight tile `w_tile` [128, 64] (after `wait_tile()`, and `free_tile()` after
            it), and its store if it ends a product. Returns the accumulator, zeroed where a
            product ended."""
            live = i < count

            @pl.when(i == 0)
            def _():
                if takes_attn:
                    plgpu.barrier_wait(a_barrier)
                unit, n = info[0]
                if first > 0:  # x's norm (`norm_qkv`), or a phase's own kernel's prologue
                    # programs without units skip it; program 0 writes h or h2
                    pl.when((n > 0) | (program == 0))(
                        jax.named_scope("prologue0")(lambda: prologue(first))
                    )

                if states and prologues:

                    @pl.when(n > 0)
                    @jax.named_scope("prologue0")
                    def _():
                        part = lax.rem(unit, ps[0].parts)
                        for r in range(rows):
                            when_live(r)(
                                functools.partial(
                                    _row_merge,
                                    *state_refs,
                                    x_smem,
                                    jnp.int32(r),
                                    part,
                                    heads_per_part=heads // ps[0].parts,
                                )
                            )
                        plgpu.commit_smem()

            for b in range(len(ps) - 1):

                @pl.when(i == local[b + 1])
                def _(b=b):
                    if barriers:
                        with jax.named_scope(f"barrier{b}"):
                            if stores == "wait":
                                plgpu.wait_smem_to_gmem(0)
                                proxy_fence()
                            grid_barrier(
                                counters_ref,
                                parity,
                                b,
                                num_programs,
                                trap=trap,
                                release=stores != "unordered",
                            )
                            proxy_fence()
                    with jax.named_scope(f"prologue{b + 1}"):
                        prologue(first + b + 1)

            at = sched.locate(i, info, local)
            phase, part, tile = at["phase"], at["part"], at["tile"]
            col = pl.multiple_of(at["k_step"] * TILE_K, TILE_K)
            row = plgpu.broadcasted_iota(jnp.int32, (TILE_N, ROWS), 0, layout=plgpu.Layout.WGMMA)
            if wait_tile is not None:
                pl.when(live)(wait_tile)

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, w_tile.T, x_smem.at[:, pl.ds(col, TILE_K)].T)

            acc = jnp.where(
                row < jnp.where(live, TILE_N, 0), pl.run_state(mma)(plgpu.ACC.init(acc)), acc
            )
            if free_tile is not None:
                pl.when(live)(free_tile)
            ends = live & at["ends"]
            dests = (o_ref, gu_ref if direct else None, d_ref, qkv_ref)[first:][: len(ps)]

            def store_regs():
                for j, dest in enumerate(dests):
                    pl.when(phase == j)(
                        lambda dest=dest: _store_partial(acc, dest, part, tile * TILE_N, rows)
                    )

            def store_tma():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                _store_transposed(acc, y_smem)
                y_rows = y_smem if rows == ROWS else y_smem.at[pl.ds(0, rows)]
                plgpu.commit_smem()
                cols = pl.ds(tile * TILE_N, TILE_N)
                for j, dest in enumerate(dests):
                    if dest is not None:
                        pl.when(phase == j)(
                            lambda dest=dest: plgpu.copy_smem_to_gmem(
                                y_rows, dest.at[part, :, cols]
                            )
                        )
                if not direct:
                    pl.when(phase == 1)(
                        lambda: plgpu.copy_smem_to_gmem(
                            y_rows, gu_ref.at[part, :, at["which"], cols]
                        )
                    )

            if stores != "none":
                pl.when(ends)(store_regs if partials == "regs" else store_tma)
            return jnp.where(row < jnp.where(ends, 0, TILE_N), acc, jnp.zeros_like(acc))

        def start():
            if counters_ref is not None:

                @pl.when(program == 0)
                def _():  # the other slot, for the next call (a last layer's uses all of them)
                    for b in range(counters.shape[1]):
                        counters_ref[1 - parity, b] = jnp.int32(0)

            if takes_attn:
                # The attention output comes in beside the first weight tiles; o's first
                # product waits for it.
                x_attn = x_smem.at[:, pl.ds(0, shape.heads_dim)]
                plgpu.copy_gmem_to_smem(attn_ref, x_attn, a_barrier)
            return plgpu.layout_cast(jnp.zeros((TILE_N, ROWS), f32), plgpu.Layout.WGMMA)

        if not direct:
            zero = start()
            with jax.named_scope("kernel"):
                plgpu.emit_pipeline(
                    lambda indices, w_tile, acc: step(indices[0], w_tile, acc),
                    grid=(sched.max_count,),
                    in_specs=[
                        plgpu.BlockSpec(
                            (TILE_K, TILE_N),
                            lambda i: (sched.locate(i, info, local)["tile_row"], 0),
                            transforms=TILED,
                        )
                    ],
                    max_concurrent_steps=stages,
                    init_carry=zero,
                )(w_refs[0])
            plgpu.wait_smem_to_gmem(0)
            return

        w_smem, (ready, free) = pipe
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _copies():
            def copy(i, carry):
                slot = lax.rem(i, stages)
                pl.when(i >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                at = sched.locate(i, info, local)
                k_rows = pl.ds(pl.multiple_of(at["w_k_step"] * TILE_K, TILE_K), TILE_K)
                cols = pl.ds(pl.multiple_of(at["tile"] * TILE_N, TILE_N), TILE_N)
                for j, w_ref in enumerate(w_refs):
                    pl.when(at["phase"] == j)(
                        lambda w_ref=w_ref: plgpu.copy_gmem_to_smem(
                            w_ref.at[k_rows, cols], w_smem.at[slot], ready.at[slot]
                        )
                    )
                return carry

            lax.fori_loop(0, count, copy, jnp.int32(0))
            if prefetch_next is not None:
                nxt = Schedule(shape, num_programs, True, only=only + 1)
                next_info, next_local = nxt.plan(program)

                def ask(i, carry):
                    at = nxt.locate(i, next_info, next_local)
                    k_rows = pl.ds(pl.multiple_of(at["w_k_step"] * TILE_K, TILE_K), TILE_K)
                    cols = pl.ds(pl.multiple_of(at["tile"] * TILE_N, TILE_N), TILE_N)
                    plgpu.async_prefetch(named["w_next"].at[k_rows, cols])
                    return carry

                lax.fori_loop(0, jnp.minimum(stages, next_local[-1]), ask, jnp.int32(0))

        @pl.when(wg == 0)
        def _compute():
            zero = start()

            def compute(i, acc):
                slot = lax.rem(i, stages)
                free_tile = lambda: plgpu.barrier_arrive(free.at[slot])  # noqa: E731
                acc = step(
                    i,
                    w_smem.at[slot],
                    acc,
                    wait_tile=lambda: plgpu.barrier_wait(ready.at[slot]),
                    free_tile=free_tile if early_free else None,
                )
                if not early_free:
                    pl.when(i < count)(free_tile)
                return acc

            with jax.named_scope("kernel"):
                lax.fori_loop(0, sched.max_count, compute, zero)
            if last:  # every down product stored; program 0 takes h2 and the final norm
                plgpu.wait_smem_to_gmem(0)
                proxy_fence()
                grid_barrier(counters_ref, parity, len(ps) - 1, num_programs, trap=trap)

                @pl.when(program == 0)
                def _():
                    norm_rows(d_ref, h_ref, s_next_ref, h2_ref, qkv_ref, jnp.int32(1), smem=False)
                    for r in range(rows if lens_ref is not None else 0):
                        # an inactive slot's final norm: zeros
                        pl.when(lens_ref[r] <= 0)(
                            functools.partial(_row_zero, qkv_ref, jnp.int32(r))
                        )

            plgpu.wait_smem_to_gmem(0)

    pipe = (
        (
            plgpu.SMEM((stages, TILE_K, TILE_N), x.dtype, transforms=TILED),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        )
        if direct
        else ()
    )
    kernel_name = "layer_kernel"
    if qkv_only:
        kernel_name = "norm_qkv_kernel"
    elif split:
        kernel_name = f"layer_{PHASE_NAMES[only]}_kernel"
    results = launch(
        body,
        tuple(outs.values()),
        tuple(ins.values()),
        grid=(num_programs,),
        grid_names=("program",),
        scratch_types=(
            plgpu.SMEM((ROWS, x_cols), x.dtype, transforms=TILED),
            plgpu.SMEM((ROWS, TILE_N), f32),
            plgpu.SMEM((THREADS // 32,), f32),
            plgpu.Barrier(),
            pipe,
        ),
        kernel_name=kernel_name,
        compiler_params=plgpu.CompilerParams(
            **(dict(profile_space=64, profile_dir=profile_dir) if profile_dir else {})
        ),
        **(dict(num_threads=2, thread_name="wg") if direct else {}),
    )
    results = dict(zip(outs, results, strict=True))
    if split:
        return results
    if qkv_only:
        return results["qkv"]
    return results["h2"], results["final" if last else "qkv"]


def _x_cols(shape: Shape, sched: Schedule) -> int:
    """Columns of the phases' x in shared memory: o's K, the hidden size (gate/up's and
    qkv's K), down's part of act."""
    cols = (shape.heads_dim, shape.hidden, None, shape.hidden)
    down = sched.local(2)
    return max(
        shape.inter // sched.phases[down].parts if j == 2 else cols[j]
        for j in range(sched.first, sched.first + len(sched.phases))
    )


def _smem_bytes(x_cols: int, stages: int) -> int:
    """A program's shared memory: x (bfloat16, 8 rows), a product's store tile, the norms'
    warp sums, the weight stages (direct) and the barriers."""
    return (
        ROWS * x_cols * 2
        + ROWS * TILE_N * 4
        + 16
        + stages * TILE_K * TILE_N * 2
        + 8 * (1 + 2 * stages)
    )


def model_shape(wo, w_gate_up, wd, wqkv, head_dim: int) -> Shape:
    """The `Shape` of a layer's matrices as `post_attention` takes them (wqkv None: the last
    layer)."""
    return Shape(
        hidden=wo.shape[1],
        heads_dim=wo.shape[0],
        inter=wd.shape[0],
        qkv=0 if wqkv is None else wqkv.shape[1],
        head_dim=head_dim,
    )


def supported(shape: Shape, rows: int, dtype, stages: int = 4) -> str | None:
    """Why `post_attention` cannot take a step of `rows` rows of this shape and dtype on this
    GPU, or None where it can: bfloat16 (the per-thread code's), at most `ROWS` rows, every
    dimension whole tiles, one warpgroup's merge per part of o's K and a schedule whose
    programs' o and down units share their part of K (`phases`)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"bfloat16 only; got {jnp.dtype(dtype).name}"
    if not 1 <= rows <= ROWS:
        return f"at most {ROWS} rows; got {rows}"
    dims = dict(hidden=shape.hidden, heads_dim=shape.heads_dim, inter=shape.inter)
    dims["qkv"] = shape.qkv or TILE_K
    if any(v % TILE_K for v in dims.values()) or shape.head_dim % (2 * RUN):
        return f"dimensions in whole {TILE_K}-column tiles and head_dim a multiple of 8; got {dims}"
    if shape.heads_dim % shape.head_dim or shape.head_dim // RUN > THREADS:
        return f"heads of at most {THREADS * RUN} columns; got head_dim {shape.head_dim}"
    num_programs = device_num_sms()
    try:
        ps = phases(shape, True, num_programs, last=not shape.qkv)
    except ValueError as e:
        return str(e)
    if num_programs % ps[2].parts:
        return f"down's {ps[2].parts} parts must divide the {num_programs} programs"
    smem = _smem_bytes(_x_cols(shape, Schedule(shape, num_programs, True, not shape.qkv)), stages)
    if smem > SMEM_LIMIT:
        return f"{smem} bytes of shared memory a program, over {SMEM_LIMIT}"
    return None


def post_attention(
    attn,
    x,
    weights,
    scale_mlp,
    scale_next,
    counters,
    *,
    parity: int,
    eps: float,
    kv_lens=None,
    stages: int = 4,
):
    """A decoder layer after its attention, and the next layer's norm and qkv, in one kernel
    (`layer` with the model's own matrices). A grid barrier that gives up (a program not
    resident: another kernel holding SMs, a GPU shared by SM limits) aborts the kernel, so
    the call fails with a CUDA error rather than returning wrong numbers.

    Args:
      attn: the decode kernel's unmerged states (out, lse) for S >= R sequence slots
        (`paged_decode.rope_append_decode_attention(..., merge=False)`).
      x: [R, hidden] bfloat16, the residual stream, R <= 8.
      weights: (wo [Hq*D, hidden], the fused gate/up [hidden, 2 I], wd [I, hidden], the
        next layer's fused wqkv [hidden, qkv]); the last layer's without wqkv.
      scale_mlp, scale_next: the post-attention norm's scale [hidden], the next layer's input
        norm's (the last layer: the final norm's).
      counters: int32 [3, 3] zeros as a `jax.new_ref`, shared by the calls of one step, which
        take `parity` 0 and 1 in turn.
      eps: the norms' epsilon.
      kv_lens: the step's i32[S]: rows of inactive slots (0) skip the per-row work, their
        h2 and qkv undefined and their final norm zero (`layer`); None: every row live.

    Returns:
      `(h2 [R, hidden], qkv f32[parts, R, qkv])`: the residual after the layer and the next
      layer's qkv as partial sums over parts of K; the last layer `(h2, its final norm
      [R, hidden])`.
    """
    wqkv = weights[3] if len(weights) == 4 else None
    shape = model_shape(*weights[:3], wqkv, attn[0].shape[-1])
    why = supported(shape, x.shape[0], x.dtype, stages)
    if why is not None:
        raise ValueError(f"post_attention does not take this layer: {why}")
    return layer(
        attn,
        x,
        tuple(weights),
        scale_mlp,
        scale_next,
        counters,
        parity=parity,
        eps=eps,
        kv_lens=kv_lens,
        stages=stages,
        trap=True,
        shape=shape,
    )


def post_attention_phases(
    attn,
    x,
    weights,
    scale_mlp,
    scale_next,
    *,
    eps: float,
    kv_lens=None,
    stages: int = 4,
    prefetch: bool = False,
):
    """`post_attention` as one kernel a phase (o, gate/up, down, qkv: `layer(..., only=j)`),
    each program taking the phase's prologue (the split merge, a residual add and norm,
    SwiGLU) first thing, beside its first weight copies, where the persistent kernel waits at
    a grid barrier and then takes it with its weight stages full. The step's seven kernels
    after attention become four, with no barrier, counter or memset. The last layer's final
    norm is `add_rms_norm`'s kernel over down's partial sums (inactive rows zeroed).

    Arguments and results as `post_attention`'s, without its counters and parity; `prefetch`:
    each kernel asks the L2 for the next one's first weight tiles (`layer`'s
    `prefetch_next`)."""
    wqkv = weights[3] if len(weights) == 4 else None
    shape = model_shape(*weights[:3], wqkv, attn[0].shape[-1])
    why = supported(shape, x.shape[0], x.dtype, stages)
    if why is not None:
        raise ValueError(f"post_attention_phases does not take this layer: {why}")

    kw = dict(eps=eps, shape=shape, prefetch=prefetch, kv_lens=kv_lens, stages=stages)
    outs = run_phases(attn, x, weights, scale_mlp, scale_next, **kw)
    if wqkv is not None:
        return outs["h2"], outs["qkv"]
    h2, final = add_rms_norm(outs["h"], outs["d"], scale_next, eps=eps)
    if kv_lens is not None:  # an inactive slot's final norm: zeros, as the persistent kernel's
        final = jnp.where(kv_lens[: x.shape[0], None] > 0, final, jnp.zeros_like(final))
    return h2, final


def run_phases(
    attn, x, weights, scale_mlp, scale_next, *, eps: float, shape=Shape(), prefetch=False, **kw
) -> dict:
    """`layer(..., only=j)` for each matrix of `weights` in turn (o, gate/up, down and, unless
    the last layer, qkv), each fed what the kernels before it wrote (`CARRIED`); with
    `prefetch` each asks the L2 for the next one's first weight tiles. Returns every kernel's
    outputs by name. `kw` as `layer`'s (kv_lens, stages, the diagnostics)."""
    outs = {}
    for j, w in enumerate(weights):
        nxt = weights[j + 1] if prefetch and j + 1 < len(weights) else None
        outs |= layer(
            attn if j == 0 else None, x, (w,), scale_mlp, scale_next, None,
            parity=0, eps=eps, only=j, carried={n: outs[n] for n in CARRIED[j]},
            prefetch_next=nxt, shape=shape, **kw,
        )  # fmt: skip
    return outs


def norm_qkv(x, wqkv, scale, *, eps: float, kv_lens=None, stages: int = 4):
    """A decode step's first layer up to its attention: the input RMSNorm of x and the fused
    qkv projection, as float32 partial sums over parts of K, in one kernel (`layer`'s qkv
    phase alone, each program taking the norm itself first, as after a barrier). In XLA
    these are a norm and a dot, which XLA rewrites as multiply + reduce at one row.

    Args:
      x: [R, hidden] bfloat16, the embedded tokens, R <= 8.
      wqkv: the layer's fused qkv [hidden, qkv]; scale: its input norm's scale [hidden].
      eps: the norm's epsilon.
      kv_lens: the step's i32[S >= R]: rows of inactive slots (0) skip the norm, their qkv
        undefined; None: every row live.

    Returns:
      f32[parts, R, qkv], summed by the decode kernel's fold as `post_attention`'s qkv.
    """
    rows, hidden = x.shape
    why = None
    if jnp.dtype(x.dtype) != jnp.bfloat16 or wqkv.dtype != x.dtype:
        why = f"bfloat16 only; got {jnp.dtype(x.dtype).name} x, {jnp.dtype(wqkv.dtype).name} wqkv"
    elif not 1 <= rows <= ROWS:
        why = f"at most {ROWS} rows; got {rows}"
    elif wqkv.shape[0] != hidden or scale.shape != (hidden,):
        why = f"x [R, {hidden}] needs wqkv [{hidden}, qkv] and scale [{hidden}]"
    elif hidden % TILE_K or wqkv.shape[1] % TILE_K:
        why = f"dimensions in whole {TILE_K}-column tiles; got wqkv {wqkv.shape}"
    elif (smem := _smem_bytes(hidden, stages)) > SMEM_LIMIT:
        why = f"{smem} bytes of shared memory a program, over {SMEM_LIMIT}"
    if why is not None:
        raise ValueError(f"norm_qkv does not take this layer: {why}")
    return layer(
        None,
        x,
        (wqkv,),
        None,
        scale,
        None,
        parity=0,
        eps=eps,
        kv_lens=kv_lens,
        stages=stages,
        shape=Shape(hidden=hidden, qkv=wqkv.shape[1]),
    )
