"""Ragged paged prefill for Hopper (sm_90), lowered through Mosaic GPU.

An XLA plan (`pallas_kernels.block_plan`, shared with the Triton prefill kernel) cuts every
sequence into blocks of 128 consecutive tokens and lists the key tiles each block needs; the
grid is (query head, block), so nothing recompiles when the batch content changes. One
program, three warpgroups:

* the copy warpgroup brings K and V in by TMA, one copy per page (a `[page_size, D]` box of
  the strided view `k_pages[page, :, kv_head, :]`), `block_kv // page_size` pages per step,
  `num_stages` steps ahead of compute;
* two compute warpgroups each own 64 rows of the block (the `wgmma` M) and share every K/V
  stage: Q K^T and P V by `wgmma`, base-2 online softmax in float32 between them. A barrier
  that both warpgroups meet twice per step staggers them by half a step, so that one's
  softmax overlaps the other's matrix products (FlashAttention-3's ping-pong schedule).

Tiles that every row of the block sees whole run without masks; the window's leading edge,
the causal diagonal and the last tile (keys past `kv_len`) are masked. Slots past `kv_len` may
hold garbage, even NaN: their logits become -inf, and their V rows are zeroed in shared memory
before the P V product (P is exactly 0 there, but 0 * NaN is NaN).

Rows are written straight into the final `[T, Hq, D]` layout by TMA boxes of 64, 32, ..., 1
rows (a block's last rows may belong to the next sequence, which must not be overwritten).
A sequence of one token (a decode token) would waste 127 rows of a block and read its KV once
per query head, so those go to the Mosaic GPU decode kernel in the same call
(`MosaicPrefillConfig.short_sequences`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import block_plan
from pallas_kernels.common import (
    finalize,
    logits_base2,
    online_softmax_step,
    poison_enabled,
    sanitize_metadata,
    visible,
)
from pallas_kernels.mosaic import paged_decode, pipeline
from pallas_kernels.mosaic.common import (
    check_inputs,
    check_pipeline,
    check_smem,
    default_block_kv,
    launch,
)

_ROWS = 64  # rows per compute warpgroup: the `wgmma` M
_COMPUTE_WGS = 2
_TOKENS = _ROWS * _COMPUTE_WGS  # rows per block
# A TMA copy into tiled shared memory starts on a tile row: Q rows are copied from multiples of
# 8 tokens, so blocks start there (`plan_blocks(align=8)`).
_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    """Tuning knobs of the Mosaic GPU prefill kernel.

    Attributes:
      block_kv: keys per pipeline step (the N of Q K^T): a multiple of 64 and of the page
        size, at most 256.
      num_stages: K/V steps buffered in shared memory (`2 * block_kv * D * 2` bytes each).
      short_sequences: send sequences of one token (the decode tokens of a mixed batch) to the
        Mosaic GPU decode kernel (`pallas_kernels.mosaic.paged_decode`) instead of giving each
        a 128-token block of its own (where the decode kernel takes the shapes: a query-head
        group of one 64-row tile, a page size that divides its step).
    """

    block_kv: int = 128
    num_stages: int = 2
    short_sequences: bool = True

    def __post_init__(self):
        check_pipeline(self.block_kv, self.num_stages)

    @classmethod
    def default(cls, head_dim: int) -> MosaicPrefillConfig:
        """The config of `config=None`: 128-key steps (64 at D=256, where two 128-key stages
        would not fit), two stages."""
        return cls(block_kv=default_block_kv(head_dim))


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    config: MosaicPrefillConfig | None = None,
    interpret: bool = False,
    short_sequences: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Attention of a flat ragged batch over paged KV (bottom-right causal), Hopper only.

    Semantics are those of `jaxpaged.reference.ragged_paged_attention_reference`, arguments
    those of `jaxpaged.ragged_paged_attention`, with q, k_pages and v_pages in bfloat16 or
    float16, D a multiple of 64 up to 256 and a
    page size that is a multiple of 8 dividing `config.block_kv`. `short_sequences=False`
    overrides `config.short_sequences`.

    Returns:
      `out` [T, Hq, D] in q's dtype and `lse` f32[T, Hq] (natural log); rows with no visible
      key and padding tokens give 0 and -inf.
    """
    head_dim = q.shape[-1]
    config = MosaicPrefillConfig.default(head_dim) if config is None else config
    if not short_sequences:
        config = dataclasses.replace(config, short_sequences=False)
    _check(q, k_pages.shape[1], config, interpret)
    return _ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=float(sm_scale),
        causal=bool(causal),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        config=config,
        poison=poison_enabled(),
    )


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "causal", "sliding_window", "logits_soft_cap", "config", "poison"),
)
def _ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    causal,
    sliding_window,
    logits_soft_cap,
    config,
    poison,
):
    del poison  # a static key only (see `poison_outputs`)
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if num_tokens == 0:
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:2], jnp.float32)
    group = num_q_heads // num_kv_heads
    meta = sanitize_metadata(
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        num_tokens=num_tokens,
        num_pages=num_pages,
        page_size=page_size,
    )
    options = dict(causal=causal, sliding_window=sliding_window)
    decode_tokens = config.short_sequences and paged_decode.supports(head_dim, page_size, group)
    plan = block_plan.plan_blocks(
        meta.cu_q_lens,
        meta.kv_lens,
        num_tokens=num_tokens,
        tokens=_TOKENS,
        block_kv=config.block_kv,
        skip_up_to=1 if decode_tokens else 0,
        align=_ALIGN,
        **options,
    )
    # LSE is written per head along tokens (TMA rows of 4-byte elements need a 16-byte
    # stride: tokens padded to a multiple of 4), and transposed in XLA.
    lse_tokens = -(-num_tokens // 4) * 4
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((num_q_heads, lse_tokens), jnp.float32),
    )
    body = _make_body(
        group=group,
        page_size=page_size,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        config=config,
        **options,
    )
    # Q copies are tiled 8 rows deep and the tiling must cover q's rows: pad to a multiple of 8
    # tokens (no copy when T is one already).
    q_rows = -(-num_tokens // _ALIGN) * _ALIGN
    padded_q = q if q_rows == num_tokens else jnp.pad(q, ((0, q_rows - num_tokens), (0, 0), (0, 0)))
    out, lse_t = launch(
        body,
        out_types,
        (plan, padded_q, k_pages, v_pages, meta.page_indices),
        scratch_types=_scratch(q.dtype, head_dim, page_size, config),
        grid=(num_q_heads, plan.shape[1]),
        grid_names=("head", "block"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        # tanh.approx is too coarse for the soft-capped logits' LSE tolerance.
        compiler_params=plgpu.CompilerParams(approx_math=logits_soft_cap is None),
    )
    lse = lse_t[:, :num_tokens].T
    if not decode_tokens:
        return out, lse
    return _attend_decode_tokens(
        q,
        k_pages,
        v_pages,
        meta,
        out,
        lse,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )


def _attend_decode_tokens(
    q, k_pages, v_pages, meta, out, lse, *, sm_scale, sliding_window, logits_soft_cap
):
    """Attention of the sequences of one token (the decode tokens of a mixed batch), by the
    Mosaic GPU decode kernel, written into their rows of `out` [T, Hq, D] and `lse` f32[T, Hq];
    other rows keep what they hold. `meta` is sanitized. Such a token sits at `kv_len - 1`,
    where causal or not it sees keys `[0, kv_len)`: the decode kernel's semantics.

    One program per (sequence, KV head), as the Triton short-sequence launch this replaces
    (`num_splits=1`: the kernel's outputs are final, no merge). The other slots are inactive
    (kv_len 0): they write rows that are dropped here.
    """
    first = meta.cu_q_lens[:-1]
    one_token = meta.cu_q_lens[1:] - first == 1
    dec_out, dec_lse = paged_decode.paged_decode_attention(
        jnp.take(q, first, axis=0, mode="clip"),
        k_pages,
        v_pages,
        jnp.where(one_token, meta.kv_lens, 0),
        meta.page_indices,
        num_splits=1,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    rows = jnp.where(one_token, first, q.shape[0])  # past the end: dropped
    return out.at[rows].set(dec_out, mode="drop"), lse.at[rows].set(dec_lse, mode="drop")


def _scratch(dtype, head_dim: int, page_size: int, config: MosaicPrefillConfig):
    tiled = pipeline.TILED
    kv = plgpu.SMEM((config.num_stages, config.block_kv, head_dim), dtype, transforms=tiled)
    pages_per_step = config.block_kv // page_size
    return (
        # A warpgroup's Q tile is dead once its last Q K^T is done; its output rows (plain
        # layout: TMA boxes of any row count) then take the same bytes.
        plgpu.RefUnion(
            plgpu.SMEM((_COMPUTE_WGS, _ROWS, head_dim), dtype, transforms=tiled),
            (
                plgpu.SMEM((_COMPUTE_WGS, _ROWS, head_dim), dtype),
                plgpu.SMEM((_COMPUTE_WGS, _ROWS), jnp.float32),
            ),
        ),
        kv,
        kv,
        plgpu.Barrier(num_barriers=_COMPUTE_WGS),  # Q arrived
        # K and V arrived: one arrival per page copy.
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=config.num_stages),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=config.num_stages),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=config.num_stages),  # K free
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=config.num_stages),  # V free
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),  # the ping-pong rendezvous
    )


def _make_body(*, group, page_size, sm_scale, causal, sliding_window, logits_soft_cap, config):
    block_kv, stages = config.block_kv, config.num_stages

    def body(
        plan_ref,
        q_ref,
        k_ref,
        v_ref,
        table_ref,
        out_ref,
        lse_ref,
        union,
        k_smem,
        v_smem,
        q_ready,
        k_ready,
        v_ready,
        k_free,
        v_free,
        rendezvous,
    ):
        q_smem, (o_smem, lse_smem) = union
        head = lax.axis_index("head")
        block = lax.axis_index("block")
        kv_head = lax.div(head, group)
        (
            seq,
            first_token,
            num_tokens,
            first_pos,
            kv_len,
            tile_lo,
            full_lo,
            full_hi,
            tile_hi,
        ) = block_plan.read_block(plan_ref, block)
        # Step i takes tile `tile_of(i)`: the tiles every row sees whole first, then the
        # window's leading edge [tile_lo, full_lo) and the diagonal / kv_len end.
        num_full = full_hi - full_lo
        num_lead = full_lo - tile_lo
        num_steps = num_full + num_lead + (tile_hi - full_hi)
        # Blocks past the batch's last (the grid is sized for the worst batch) have no tokens
        # and no tiles: their programs skip everything, instead of each waiting on a Q copy.
        has_tokens = num_tokens > 0

        def tile_of(i):
            edge = i - num_full
            return jnp.where(
                edge < 0,
                full_lo + i,
                jnp.where(edge < num_lead, tile_lo + edge, full_hi + edge - num_lead),
            )

        def meet():
            plgpu.barrier_arrive(rendezvous)
            plgpu.barrier_wait(rendezvous)

        wg = lax.axis_index("wg")

        @pl.when(wg == _COMPUTE_WGS)
        def _copy_pages():
            plgpu.set_max_registers(40, action="decrease")
            last = pipeline.last_page_of(kv_len, page_size)
            kv = ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free))

            @pl.loop(0, num_steps)
            def _step(i):
                slot = lax.rem(i, stages)
                pipeline.copy_step(
                    kv,
                    table_ref,
                    seq=seq,
                    block=tile_of(i),
                    last_page=last,
                    kv_head=kv_head,
                    slot=slot,
                    step=i,
                )

        # The block's rows are tokens [row0_token, row0_token + 128), of which
        # [first_token, first_token + num_tokens) are the sequence's: a first block starts
        # up to 7 rows early (see `plan_blocks(align=...)`).
        shift = lax.rem(first_token, _ALIGN)
        row0_token = first_token - shift

        @pl.when((wg < _COMPUTE_WGS) & has_tokens)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            row0 = wg * _ROWS  # this warpgroup's first row in the block
            q_tile = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(
                q_ref.at[pl.ds(pl.multiple_of(row0_token + row0, _ALIGN), _ROWS), head],
                q_tile,
                q_ready.at[wg],
            )
            head_dim = q_tile.shape[-1]
            layout = plgpu.Layout.WGMMA
            acc = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), layout)
            m = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32), layout.reduce(1))
            l = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), layout.reduce(1))
            plgpu.barrier_wait(q_ready.at[wg])
            q_pos = (
                first_pos
                - shift
                + row0
                + plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 0, layout=layout)
            )
            # Warpgroup 1 starts half a step behind warpgroup 0.
            pl.when(wg == 1)(meet)

            def step(i, carry, *, masked: bool):
                acc, m, l = carry
                slot = lax.rem(i, stages)
                start = tile_of(i) * block_kv
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                    meet()
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((_ROWS, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                logits2 = logits_base2(s, sm_scale, logits_soft_cap)
                if masked:
                    key = start + plgpu.broadcasted_iota(
                        jnp.int32, (_ROWS, block_kv), 1, layout=layout
                    )
                    ok = visible(q_pos, key, kv_len, causal=causal, sliding_window=sliding_window)
                    # NaN logits of keys past kv_len are replaced here, never used.
                    logits2 = jnp.where(ok, logits2, -jnp.inf)
                m, l, alpha, p = online_softmax_step(m, l, logits2)
                acc = acc * alpha[:, None]
                p = p.astype(v_smem.dtype)
                plgpu.barrier_arrive(rendezvous)  # softmax done: the other may multiply
                plgpu.barrier_wait(v_ready.at[slot])
                if masked:  # both warpgroups may zero at once: they write the same values
                    pipeline.zero_invisible_v(v_smem.at[slot], start, kv_len, None)

                plgpu.barrier_wait(rendezvous)  # the tensor cores are ours

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, l

            carry = (acc, m, l)
            carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(num_full, num_steps, functools.partial(step, masked=True), carry)
            pl.when(wg == 0)(meet)
            out, lse = finalize(*carry)
            o_tile, lse_tile = o_smem.at[wg], lse_smem.at[wg]
            o_tile[...] = out.astype(o_tile.dtype)
            lse_tile[...] = lse
            plgpu.commit_smem()
            _store_rows(
                o_tile,
                lse_tile,
                out_ref,
                lse_ref,
                head,
                row0_token + row0,
                jnp.clip(shift - row0, 0, _ROWS),
                jnp.clip(shift + num_tokens - row0, 0, _ROWS),
            )

    return body


def _store_rows(o_tile, lse_tile, out_ref, lse_ref, head, token, lo, hi):
    """Write rows `[lo, hi)` of a warpgroup's output to tokens `token + lo ...` of `head`: TMA
    boxes of 64, 32, ..., 1 rows, one per set bit of the row count, so that no row outside the
    block's sequence is touched. LSE: one TMA row for a whole tile, plain stores otherwise
    (only a sequence's first and last blocks are partial)."""
    count = jnp.maximum(hi - lo, 0)
    bit = _ROWS
    while bit:
        row = lo + (count & -(2 * bit))  # the rows of the larger boxes come first

        @pl.when(count & bit != 0)
        def _box(bit=bit, row=row):
            plgpu.copy_smem_to_gmem(
                o_tile.at[pl.ds(row, bit)], out_ref.at[pl.ds(token + row, bit), head]
            )

        bit //= 2

    @pl.when(count == _ROWS)
    def _whole_lse():
        plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[head, pl.ds(token, _ROWS)])

    @pl.when(count < _ROWS)
    def _partial_lse():
        @pl.loop(lo, hi)
        def _row(r):
            lse_ref[head, token + r] = lse_tile[r]

    plgpu.wait_smem_to_gmem(0)


def _check(q, page_size, config, interpret) -> None:
    head_dim = q.shape[-1]
    check_inputs("prefill", q.dtype, head_dim, page_size, config, interpret)
    itemsize = jnp.dtype(q.dtype).itemsize
    smem = (2 * config.num_stages * config.block_kv + _TOKENS) * head_dim * itemsize
    check_smem(config, smem, head_dim)
