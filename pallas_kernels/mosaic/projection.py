"""A decode step's projection on Hopper: `y = x @ w` for a few rows of x (Mosaic GPU), every SM
streaming an equal share of the weights, the split sums and SwiGLU done in the same kernel.

At decode batch sizes a projection reads far more weight bytes than it does FLOPs, so what
bounds it is how evenly the weights spread over the SMs and how many kernels a layer pays for.
XLA picks split-K GEMMs for most of a decode step's projections and sums their splits in a
kernel of its own, and SwiGLU's `silu(gate) * up` is one more (benchmarks/NOTES.md).

The walk (stream-K): the iterations `(output tile, K step)` of the whole product, tile-major,
are cut into one contiguous, equal share per program, one program per SM. A program runs its
share as segments, one per tile it touches. A segment that starts at its tile's first K step
makes its program the tile's owner; a segment that starts inside a tile (only a share's first
segment can) is a contribution: its float32 partial goes to a workspace row of its program,
and a GMEM semaphore of the tile counts it. The owner's segment ends its share's walk (a share
reaches its owned tiles last), so the owner waits for the count it expects (the programs whose
shares start inside the tile), adds their partials and writes the tile. The wait decrements
the semaphore back to zero. All programs are resident at once (one per SM), so a wait on a
later program's contribution always ends.

The weights are `wgmma`'s M operand and x its N (swapped, so that a decode batch of T rows
takes an N of T rounded up to 8 rather than an M of 64): a step reads a `[tile_k, TILE_N]` box
of w and a `[T, tile_k]` box of x (both transposed as `wgmma` reads them), and the accumulator
is the tile of y transposed, which the epilogue writes through a transposed view of shared
memory. Rows past 8 are whole 8-row tiles (a T past 8 that 8 does not divide is padded).

SwiGLU (`activation="swiglu"`): w holds gate and up columns as blocks of `TILE_N` (gate block
j, then up block j: `jaxpaged.fuse_gate_up`), and the kernel writes
`silu(x @ gate) * (x @ up)`, [T, N / 2]: a tile is both blocks, one accumulator each.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import device_num_sms
from pallas_kernels.mosaic.common import DTYPES, SMEM_LIMIT, launch
from pallas_kernels.mosaic.pipeline import SWIZZLE, TILED

ROWS = 64  # the M of a wgmma: x rows one call takes
TILE_N = 64  # output columns of a tile (and of a SwiGLU block)
ACTIVATIONS = (None, "swiglu")


@dataclasses.dataclass(frozen=True)
class ProjectionConfig:
    """Tuning of `projection`.

    Attributes:
      tile_k: K of a pipeline step (a multiple of 64: 128-byte swizzled rows).
      num_stages: pipeline steps of x and w in flight.
      num_programs: programs of the walk; None: one per SM.
      pdl: launch as a programmatic dependent (PDL): the kernel may start while the one
        before it finishes. Its pipeline's first weight copies go out at once (weights do not
        depend on the kernel before), then it waits for that kernel (`griddepcontrol.wait`)
        and copies all of x into shared memory (x is then not in the pipeline), and lets the
        kernel after it start.
    """

    tile_k: int = 128
    num_stages: int = 4
    num_programs: int | None = None
    pdl: bool = False


def supported(x_shape, w_shape, dtype, activation=None) -> bool:
    """Whether `projection` takes these shapes: at most `ROWS` rows, K a multiple of 64, N of
    `TILE_N` (of two for SwiGLU), a 16-bit dtype."""
    rows, k = x_shape
    n = w_shape[1]
    blocks = 2 * TILE_N if activation == "swiglu" else TILE_N
    return (
        1 <= rows <= ROWS
        and w_shape[0] == k
        and k % 64 == 0
        and n % blocks == 0
        and jnp.dtype(dtype) in DTYPES
    )


@functools.partial(jax.jit, static_argnames=("activation", "config"))
def projection(
    x: jax.Array,
    w: jax.Array,
    *,
    activation: str | None = None,
    config: ProjectionConfig | None = None,
) -> jax.Array:
    """`x @ w` (float32 accumulation, rounded to x's dtype), or SwiGLU of it.

    Args:
      x: [T, K] with T <= 64, bfloat16 or float16.
      w: [K, N] of x's dtype. For "swiglu", gate and up blocks of `TILE_N` columns in turn.
      activation: None, or "swiglu" (`silu(gate) * up`, [T, N / 2]).
      config: `ProjectionConfig` (None: the default).

    Returns:
      [T, N] (or [T, N / 2]) in x's dtype.
    """
    config = config or ProjectionConfig()
    _check(x, w, activation, config)
    rows, k = x.shape
    if rows > 8 and rows % 8:  # TMA boxes of 8-row tiles: an array of more rows needs whole tiles
        padded = jnp.pad(x, ((0, -rows % 8), (0, 0)))
        return projection(padded, w, activation=activation, config=config)[:rows]
    block_rows = max(8, rows)
    halves = 2 if activation == "swiglu" else 1
    n_out = w.shape[1] // halves
    tile_k, stages = config.tile_k, config.num_stages
    k_steps = k // tile_k
    num_tiles = n_out // TILE_N
    total = num_tiles * k_steps
    num_programs = min(config.num_programs or device_num_sms(), total)
    max_count = pl.cdiv(total, num_programs)

    # Named for profiles (CUPTI names a Mosaic kernel after its body).
    def projection_matmul(x_ref, *refs):
        w_refs, (y_ref, ws_ref, y_smem, *resident) = refs[:halves], refs[halves:]
        program = lax.axis_index("program")
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((num_tiles,)))
        first = program * total // num_programs
        count = (program + 1) * total // num_programs - first

        def iteration(i):  # pipeline step i's iteration (steps past the share repeat the last)
            return first + jnp.minimum(i, count - 1)

        def finish(accs, g, start):
            """The segment [start, g] of tile g // k_steps ends: contribute, or own and write."""
            tile = g // k_steps
            owner = lax.rem(start, k_steps) == 0

            @pl.when(~owner)
            def _contribute():
                for h in range(halves):
                    ws_ref[program, h] = accs[h]
                plgpu.semaphore_signal(sems.at[tile], 1, memory_scope="gpu")

            @pl.when(owner)
            def _own():
                # Programs whose shares start inside the tile: q * total < end * P, past ours.
                end = (tile + 1) * k_steps
                starting_before_end = jnp.minimum(
                    num_programs, (end * num_programs + total - 1) // total
                )
                helpers = starting_before_end - (program + 1)

                @pl.when(helpers > 0)
                def _wait():
                    plgpu.semaphore_wait(sems.at[tile], helpers, memory_scope="gpu")

                def add(q, accs):
                    return tuple(
                        a + plgpu.load(ws_ref.at[q, h], layout=plgpu.Layout.WGMMA, optimized=False)
                        for h, a in enumerate(accs)
                    )

                total_accs = lax.fori_loop(program + 1, program + 1 + helpers, add, tuple(accs))
                if activation == "swiglu":
                    gate, up = total_accs
                    out = gate * jax.nn.sigmoid(gate) * up
                else:
                    (out,) = total_accs
                # The accumulator is y's tile transposed ([columns, rows]).
                y_smem.T[...] = out.astype(y_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    y_smem.at[pl.ds(0, rows)], y_ref.at[:, pl.ds(tile * TILE_N, TILE_N)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def step(indices, *smems_and_carry):
            (i,) = indices
            *smems, (accs, start) = smems_and_carry
            g = iteration(i)
            if config.pdl:
                x_all, x_ready = resident
                w_smems = smems

                @pl.when(i == 0)
                def _wait_for_x():
                    plgpu.griddepcontrol_wait()
                    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, block_rows)], x_all, x_ready)
                    plgpu.barrier_wait(x_ready)
                    plgpu.griddepcontrol_launch_dependents()

                x_smem = x_all.at[
                    :, pl.ds(pl.multiple_of(lax.rem(g, k_steps) * tile_k, 64), tile_k)
                ]
            else:
                x_smem, *w_smems = smems
            live = i < count
            # Mosaic's select takes no scalar predicate: compare an iota with 0 or TILE_N.
            col = plgpu.broadcasted_iota(
                jnp.int32, (TILE_N, block_rows), 0, layout=plgpu.Layout.WGMMA
            )

            def mma(w_smem, acc_ref):  # out^T += w^T x^T: the weights are wgmma's M
                plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)

            accs = tuple(
                jnp.where(
                    col < jnp.where(live, TILE_N, 0),
                    pl.run_state(functools.partial(mma, w_smem))(plgpu.ACC.init(a)),
                    a,
                )
                for w_smem, a in zip(w_smems, accs, strict=True)
            )
            ends = live & ((lax.rem(g, k_steps) == k_steps - 1) | (i == count - 1))

            @pl.when(ends)
            def _finish():
                finish(accs, g, start)

            keep = col < jnp.where(ends, 0, TILE_N)
            accs = tuple(jnp.where(keep, a, jnp.zeros_like(a)) for a in accs)
            return accs, jnp.where(ends, g + 1, start)

        def w_spec(h):  # tile j's columns of w: block j, or gate / up block pair j
            return plgpu.BlockSpec(
                (tile_k, TILE_N),
                lambda i: (lax.rem(iteration(i), k_steps), halves * (iteration(i) // k_steps) + h),
                transforms=TILED,
            )

        zero = plgpu.layout_cast(jnp.zeros((TILE_N, block_rows), jnp.float32), plgpu.Layout.WGMMA)
        x_spec = plgpu.BlockSpec(
            (block_rows, tile_k), lambda i: (0, lax.rem(iteration(i), k_steps)), transforms=TILED
        )
        x_in = () if config.pdl else (x_ref,)
        plgpu.emit_pipeline(
            step,
            grid=(max_count,),
            in_specs=[*((x_spec,) if x_in else ()), *(w_spec(h) for h in range(halves))],
            max_concurrent_steps=stages,
            init_carry=((zero,) * halves, first),
        )(*x_in, *w_refs)

    out_types = (
        jax.ShapeDtypeStruct((rows, n_out), x.dtype),
        jax.ShapeDtypeStruct((num_programs, halves, TILE_N, block_rows), jnp.float32),
    )
    y, _ = launch(
        projection_matmul,
        out_types,
        (x, *(w,) * halves),
        grid=(num_programs,),
        grid_names=("program",),
        scratch_types=(
            plgpu.SMEM((block_rows, TILE_N), x.dtype),
            *(
                (plgpu.SMEM((block_rows, k), x.dtype, transforms=TILED), plgpu.Barrier())
                if config.pdl
                else ()
            ),
        ),
    )
    return y


def smem_bytes(
    config: ProjectionConfig, dtype, activation=None, rows: int = ROWS, k: int = 0
) -> int:
    """Shared memory of one program: the stages of w (and of x, or with `pdl` all of x's K
    columns) and the output tile."""
    halves = 2 if activation == "swiglu" else 1
    size = jnp.dtype(dtype).itemsize
    block_rows = max(8, -(-rows // 8) * 8)
    x_stage = 0 if config.pdl else block_rows
    stage = (x_stage + halves * TILE_N) * config.tile_k * size
    resident = block_rows * k * size if config.pdl else 0
    return config.num_stages * stage + block_rows * TILE_N * size + resident


def _check(x, w, activation, config) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [T, K] and w [K, N]; got {x.shape}, {w.shape}")
    if x.dtype != w.dtype:
        raise TypeError(f"x and w must share a dtype; got {x.dtype}, {w.dtype}")
    if not supported(x.shape, w.shape, x.dtype, activation):
        blocks = 2 * TILE_N if activation == "swiglu" else TILE_N
        raise ValueError(
            f"the Mosaic projection takes x [T <= {ROWS}, K] and w [K, N] with K a multiple "
            f"of 64, N of {blocks} and a 16-bit dtype; got x {x.dtype}{list(x.shape)}, "
            f"w {list(w.shape)}"
        )
    if config.tile_k % (SWIZZLE // 2) or x.shape[1] % config.tile_k:
        raise ValueError(
            f"config.tile_k must be a multiple of 64 that divides K={x.shape[1]}; "
            f"got {config.tile_k}"
        )
    if config.num_stages < 1:
        raise ValueError(f"config.num_stages must be >= 1; got {config.num_stages}")
    smem = smem_bytes(config, x.dtype, activation, x.shape[0], x.shape[1])
    if smem > SMEM_LIMIT:
        raise ValueError(f"config {config} needs {smem} bytes of shared memory, over {SMEM_LIMIT}")
