"""Decode attention that reads a shared prefix once per group of sequences (cascade attention).

Sequences forked from one prompt (`SamplingParams(n=...)`) or started on the same cached pages
(prefix caching) hold the same first pages. Plain decode reads those pages once per sequence.
Here the queries of a group of such sequences attend the shared pages together, packed as the
rows of one bigger GQA group, in one decode call over the group's page-table row; each sequence
attends its own remaining pages (its suffix) in a second call, and `merge_attention_states`
combines the two. The shared pages' K/V are read once per group instead of once per member.

    groups = find_prefix_groups(page_indices, kv_lens, page_size, max_group_size=8)
    out = shared_prefix_decode_attention(q, k_pages, v_pages, kv_lens, page_indices, groups)

`find_prefix_groups` is jittable and runs on the device once per step (every layer shares its
`PrefixGroups`, as it shares `StepMetadata`); `validate_prefix_groups` checks a descriptor
built by hand on the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpaged.attention import (
    _check_index,
    _check_kv,
    _check_options,
    _check_table,
    paged_decode_attention,
    resolve_implementation,
)
from pallas_kernels.common import merge_states, poison_enabled

# `find_prefix_groups`' default threshold for `PrefixGroups.use`: the KV tokens per step and
# KV head that reading each shared page once saves. Below it, the second decode call and the
# query gathers cost about what they save. A first guess, to be tuned on the GPU.
MIN_SAVED_TOKENS = 4096


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("members", "shared_pages", "group_of", "rank_of", "use"),
    meta_fields=(),
)
@dataclasses.dataclass(frozen=True)
class PrefixGroups:
    """Which sequences of a decode step share their first pages (a pytree).

    Shapes are static, contents change per step: there is room for one group per sequence slot
    (S groups) of up to `max_group_size` (n) members each.

    members: i32[S, n], the slots of group g's members in columns 0, 1, ... and -1 after them;
      member 0's page-table row is the one the group's prefix is read through.
    shared_pages: i32[S], how many pages at the start of every member's page table group g
      shares (0: group g is empty). They are full and hold no member's new token.
    group_of: i32[S], the group of each sequence slot (-1: none).
    rank_of: i32[S], its column in `members` (-1: none).
    use: bool[], take the shared-prefix path in this step; False runs one plain decode call.
    """

    members: jax.Array
    shared_pages: jax.Array
    group_of: jax.Array
    rank_of: jax.Array
    use: jax.Array

    @property
    def num_groups(self) -> int:
        return self.members.shape[0]

    @property
    def max_group_size(self) -> int:
        return self.members.shape[1]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=(
        "groups",
        "prefix_members",
        "prefix_kv_lens",
        "prefix_table",
        "back_group",
        "back_rank",
        "mine",
        "suffix_kv_lens",
        "suffix_table",
    ),
    meta_fields=(),
)
@dataclasses.dataclass(frozen=True)
class CascadePlan:
    """A step's `PrefixGroups` as the metadata of the cascade's two decode calls (a pytree):
    what every layer would otherwise derive again (`plan_cascade`, once per step).

    The prefix call runs over the nonempty groups only, packed into `Gs` group slots:
    `max(1, S // 2)` by default (a group has at least two members, so there are at most S / 2
    of them), or the `max_groups` of `plan_cascade`. Each slot is a work item of the prefix
    call per KV head and split whether a group fills it or not.

    groups: the `PrefixGroups` it was planned from (`use` decides the path).
    prefix_members: i32[Gs, n], the members of each packed group (-1: none).
    prefix_kv_lens, prefix_table: i32[Gs], i32[Gs, pages_per_seq], the prefix call's KV
      lengths (the shared tokens) and page-table rows (member 0's).
    back_group, back_rank: i32[S], the packed group and rank of each sequence's prefix rows.
    mine: bool[S], whether a sequence has a prefix (False: its prefix LSE is -inf).
    suffix_kv_lens, suffix_table: i32[S], i32[S, pages_per_seq], the suffix call's: each
      sequence's KV length and page table past its shared pages.
    """

    groups: PrefixGroups
    prefix_members: jax.Array
    prefix_kv_lens: jax.Array
    prefix_table: jax.Array
    back_group: jax.Array
    back_rank: jax.Array
    mine: jax.Array
    suffix_kv_lens: jax.Array
    suffix_table: jax.Array

    @property
    def use(self) -> jax.Array:
        return self.groups.use


def plan_cascade(
    groups: PrefixGroups,
    page_indices: jax.Array,
    kv_lens: jax.Array,
    page_size: int,
    *,
    max_groups: int | None = None,
) -> CascadePlan:
    """The `CascadePlan` of a decode step's groups, page table and KV lengths (jittable; call
    it once per step and pass the plan to every layer's `shared_prefix_decode_attention`).
    Every index is clamped: garbage `groups` give wrong numbers, never an access outside the
    arrays.

    `max_groups`: the prefix call's group slots (static; None: every group the step may have,
    `max(1, S // 2)`). A slot no group fills still costs the prefix call its work items (at 8
    prompts x 8 samples of 4096 shared tokens, 32 slots took 68.2 us against 63.5 for 8:
    benchmarks/NOTES.md, session 14), so a caller that knows its batch (say, requests of n
    samples: S / n groups) passes that. Groups past the slots, in slot order of their first
    members, read their prefix in the suffix call as if they shared nothing: the same
    attention, without the saving."""
    _check_table(kv_lens, page_indices)
    _check_group_arrays(groups, kv_lens.shape[0])
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1; got {page_size!r}")
    if max_groups is not None and (
        not isinstance(max_groups, int) or isinstance(max_groups, bool) or max_groups < 1
    ):
        raise ValueError(f"max_groups must be None or an int >= 1; got {max_groups!r}")
    return _plan_cascade(groups, page_indices, kv_lens, page_size=page_size, max_groups=max_groups)


@functools.partial(jax.jit, static_argnames=("page_size", "max_groups"))
def _plan_cascade(groups, page_indices, kv_lens, *, page_size, max_groups=None):
    num_seq_slots, pages_per_seq = page_indices.shape
    size = groups.max_group_size
    slot = functools.partial(jnp.clip, min=0, max=num_seq_slots - 1)
    members = groups.members
    present = (members >= 0) & (members < num_seq_slots)
    shared = jnp.where(present[:, 0], jnp.clip(groups.shared_pages, 0, pages_per_seq), 0)
    num_group_slots = max(1, num_seq_slots // 2) if max_groups is None else max_groups
    nonempty = shared > 0
    # Each group's packed slot; num_group_slots (dropped, below) past the last one.
    packed = jnp.where(nonempty, jnp.cumsum(nonempty) - 1, num_group_slots)
    packed = jnp.minimum(packed, num_group_slots)
    group_slot = (
        jnp.full((num_group_slots,), -1, jnp.int32)
        .at[packed]
        .set(jnp.arange(num_seq_slots, dtype=jnp.int32), mode="drop")
    )
    prefix_members = jnp.where(group_slot[:, None] >= 0, members[slot(group_slot)], -1)
    prefix_members = jnp.where(
        (prefix_members >= 0) & (prefix_members < num_seq_slots), prefix_members, -1
    )
    prefix_shared = jnp.where(group_slot >= 0, shared[slot(group_slot)], 0)
    # Back to sequences: rows (h, rank_of[s], :) of packed group packed[group_of[s]] are s's.
    g, r = slot(groups.group_of), jnp.clip(groups.rank_of, 0, size - 1)
    mine = (
        (groups.group_of >= 0)
        & (groups.group_of < num_seq_slots)
        & (groups.rank_of >= 0)
        & (groups.rank_of < size)
        & (members[g, r] == jnp.arange(num_seq_slots))
        & (packed[g] < num_group_slots)
    )
    # Suffix: each sequence's page table shifted past its shared pages.
    own = jnp.where(mine, shared[g], 0)
    shifted = jnp.clip(jnp.arange(pages_per_seq)[None, :] + own[:, None], 0, pages_per_seq - 1)
    return CascadePlan(
        groups=groups,
        prefix_members=prefix_members,
        prefix_kv_lens=prefix_shared * page_size,
        prefix_table=page_indices[slot(prefix_members[:, 0])],
        back_group=jnp.clip(packed[g], 0, num_group_slots - 1),
        back_rank=r,
        mine=mine,
        suffix_kv_lens=jnp.maximum(kv_lens - own * page_size, 0),
        suffix_table=jnp.take_along_axis(page_indices, shifted, axis=1),
    )


def default_max_group_size(num_q_heads: int, num_kv_heads: int) -> int:
    """The largest `max_group_size` that every decode backend takes for Hq query heads over Hkv
    KV heads (G = Hq / Hkv).

    The prefix call gives each KV head n * G query rows. The Mosaic GPU decode kernel holds
    them in one 64-row `wgmma` tile (its Q copy in whole 8-row tiles: n * G <= 64 when n * G is
    a multiple of 8); the Triton kernel rounds them up to a power of two (at least 16) and
    takes any count, and the XLA reference any. 32 at G=2, 16 at G=4, 1 from G=64 on.
    """
    from pallas_kernels.mosaic import decode_body

    group = num_q_heads // num_kv_heads
    size = max(1, decode_body.TILE_M // group)
    while size > 1 and decode_body.q_copy_rows(size * group) > decode_body.TILE_M:
        size -= 1
    return size


def default_prefix_splits(
    implementation: str, num_groups: int, num_kv_heads: int, max_kv_len: int, head_dim: int, dtype
) -> int | None:
    """The KV splits per group of the prefix call when `prefix_num_splits` is None: the decode
    kernel's own rule (`choose_num_splits` of "mosaic" or "triton") for a batch of `num_groups`
    sequences of up to `max_kv_len` tokens; for "triton" half of it (its prefix programs hold
    n * G query rows, not G: at 8 groups of 4096 and 16384 shared tokens half the rule's 8 and
    17 splits took 82 and 205 us against 96 and 239, benchmarks/NOTES.md run 77).
    `shared_prefix_decode_attention` passes ceil(S / max_group_size) groups, the count when
    every sequence is in a full group: the kernel's rule for the call's static S slots would
    count the empty slots as busy and give a handful of long groups one program per KV head.
    None for backends without splits."""
    if implementation == "mosaic":
        from pallas_kernels.common import device_num_sms
        from pallas_kernels.mosaic import common, paged_decode

        steps = -(-max_kv_len // common.default_block_kv(head_dim))
        return paged_decode.choose_num_splits(
            num_groups, num_kv_heads, steps, num_sms=device_num_sms()
        )
    if implementation == "triton":
        from pallas_kernels.common import device_num_sms
        from pallas_kernels.triton import paged_decode

        block_kv = paged_decode.DecodeConfig.default(head_dim, dtype).block_kv
        splits = paged_decode.choose_num_splits(
            num_groups, num_kv_heads, max_kv_len, block_kv=block_kv, num_sms=device_num_sms()
        )
        return max(1, splits // 2)
    return None


def find_prefix_groups(
    page_indices: jax.Array,
    kv_lens: jax.Array,
    page_size: int,
    *,
    max_group_size: int,
    min_saved_tokens: int = MIN_SAVED_TOKENS,
) -> PrefixGroups:
    """Group the active sequences of a decode step whose first pages are the same pages.

    Jittable, static shapes, no host sync (the engine calls it inside its decode steps and
    blocks). The rule:
    - A page of sequence s may be shared if it is full and wholly below its new token at
      position `kv_len - 1`: its first `(kv_len - 1) // page_size` pages. The page the step
      writes and every page after it stay in the suffix, so each suffix holds at least one key.
    - The class of s: the active sequences whose page 0 is s's page 0 (and may be shared). A
      class of m sequences splits, in slot order, into `ceil(m / max_group_size)` groups of
      near-equal size; group g is named by its first member's slot. A group of one member is
      no group.
    - `shared_pages` of a group: the longest run of pages, from page 0, that every member
      holds at the same table positions, within each member's shareable pages.
    - `use`: the KV tokens not read, `sum((size - 1) * shared_pages * page_size)` over the
      groups, reach `min_saved_tokens` (0: always; the shared-prefix path is then taken even
      with no group).

    Why it is safe: attention reads position j of s through `page_indices[s, j // page_size]`.
    Where every member's table names the same page at the same position, and that page lies
    wholly below every member's `kv_len`, attending it once through member 0's row (with the
    group's kv_len `shared_pages * page_size`) covers exactly the keys each member reads there
    through its own row, and the suffix call reads the rest. Leaving out the page of the new
    token, which this step's append writes and a pool never shares, keeps the shared part to
    pages that were full and cached before the step (the only pages a pool shares) and gives
    every suffix its new key. The table alone decides: no refcount is read.

    Args:
      page_indices: i32[S, pages_per_seq], the step's page table (-1 past a sequence's pages).
      kv_lens: i32[S], KV lengths including the new token; 0 marks an inactive slot.
      page_size: tokens per page.
      max_group_size: most members per group (n; `default_max_group_size` for the model).
      min_saved_tokens: the threshold of `use`, an int >= 0.

    Returns:
      `PrefixGroups` with S groups of up to `max_group_size` members.
    """
    _check_table(kv_lens, page_indices)
    for name, value, least in (
        ("page_size", page_size, 1),
        ("max_group_size", max_group_size, 1),
        ("min_saved_tokens", min_saved_tokens, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}; got {value!r}")
    return _find_prefix_groups(
        page_indices,
        kv_lens,
        page_size=page_size,
        max_group_size=max_group_size,
        min_saved_tokens=min_saved_tokens,
    )


@functools.partial(jax.jit, static_argnames=("page_size", "max_group_size", "min_saved_tokens"))
def _find_prefix_groups(page_indices, kv_lens, *, page_size, max_group_size, min_saved_tokens):
    num_seq_slots, pages_per_seq = page_indices.shape
    slots = jnp.arange(num_seq_slots, dtype=jnp.int32)
    shareable = jnp.clip((kv_lens - 1) // page_size, 0, pages_per_seq)
    first = page_indices[:, 0]
    eligible = (kv_lens > 0) & (shareable > 0) & (first >= 0)
    # [S, S] pairs: same class, and t before s in slot order.
    same = eligible[:, None] & eligible[None, :] & (first[:, None] == first[None, :])
    before = slots[None, :] < slots[:, None]
    rank = jnp.sum(same & before, axis=1, dtype=jnp.int32)
    size = jnp.sum(same, axis=1, dtype=jnp.int32)
    num_chunks = -(-size // max_group_size)
    chunk = rank * num_chunks // jnp.maximum(size, 1)
    together = same & (chunk[:, None] == chunk[None, :])
    leader = jnp.min(jnp.where(together, slots[None, :], num_seq_slots), axis=1)
    column = jnp.sum(together & before, axis=1, dtype=jnp.int32)
    grouped = eligible & (jnp.sum(together, axis=1) >= 2)

    leader_row = page_indices[jnp.clip(leader, 0, num_seq_slots - 1)]
    run = jnp.sum(jnp.cumprod(page_indices == leader_row, axis=1), axis=1, dtype=jnp.int32)
    group_of = jnp.where(grouped, leader, -1)
    target = jnp.where(grouped, leader, num_seq_slots)  # out of range: dropped
    shared_pages = (
        jnp.full((num_seq_slots,), pages_per_seq, jnp.int32)
        .at[target]
        .min(jnp.minimum(run, shareable), mode="drop")
    )
    is_group = jnp.zeros((num_seq_slots,), bool).at[target].set(True, mode="drop")
    shared_pages = jnp.where(is_group, shared_pages, 0)
    members = (
        jnp.full((num_seq_slots, max_group_size), -1, jnp.int32)
        .at[target, column]
        .set(slots, mode="drop")
    )
    own_shared = jnp.where(grouped, shared_pages[jnp.clip(group_of, 0, num_seq_slots - 1)], 0)
    saved = jnp.sum(jnp.where(column > 0, own_shared, 0)) * page_size
    return PrefixGroups(
        members=members,
        shared_pages=shared_pages,
        group_of=group_of,
        rank_of=jnp.where(grouped, column, -1),
        use=saved >= min_saved_tokens,
    )


def validate_prefix_groups(groups: PrefixGroups, page_indices, kv_lens, page_size: int) -> None:
    """Raise `ValueError` naming the first rule a hand-built `groups` breaks for a decode step
    over `page_indices` i32[S, pages_per_seq] and `kv_lens` i32[S].

    On the host, with the arrays concrete (inside `jit` a bad descriptor gives wrong numbers
    but no out-of-bounds access). Rules: the fields' shapes and dtypes (`PrefixGroups`); a
    group's members are slots in [0, S) packed from column 0; no slot is in two groups (or
    twice in one); `group_of` and `rank_of` say where each member sits in `members` and are -1
    for every other slot; `shared_pages` lies in [0, pages_per_seq] and is 0 exactly for the
    groups without members; every member is active, its first `shared_pages` pages are
    member 0's and they lie below its new token (`shared_pages * page_size <= kv_len - 1`).
    """
    table, lens = np.asarray(page_indices), np.asarray(kv_lens)
    num_seq_slots, pages_per_seq = table.shape
    _check_group_arrays(groups, num_seq_slots)
    members, shared = np.asarray(groups.members), np.asarray(groups.shared_pages)
    group_of, rank_of = np.asarray(groups.group_of), np.asarray(groups.rank_of)
    where: dict[int, tuple[int, int]] = {}
    for g, row in enumerate(members.tolist()):
        size = sum(s >= 0 for s in row)
        if row[size:] != [-1] * (len(row) - size) or any(s < -1 for s in row):
            raise ValueError(
                f"PrefixGroups.members[{g}] = {row}: members are slots packed from column 0, "
                "-1 after them"
            )
        for r, s in enumerate(row[:size]):
            if s >= num_seq_slots:
                raise ValueError(
                    f"PrefixGroups.members[{g}, {r}] = {s} is outside [0, S={num_seq_slots})"
                )
            if s in where:
                raise ValueError(
                    f"slot {s} is in two groups (or twice in one): members{list(where[s])} "
                    f"and members[{g}, {r}]"
                )
            where[s] = (g, r)
        if not 0 <= shared[g] <= pages_per_seq:
            raise ValueError(
                f"PrefixGroups.shared_pages[{g}] = {shared[g]} is outside [0, pages_per_seq="
                f"{pages_per_seq}]"
            )
        if (shared[g] == 0) != (size == 0):
            raise ValueError(
                f"group {g} has {size} members and shared_pages {shared[g]}: shared_pages is 0 "
                "exactly for the groups without members"
            )
    for s in range(num_seq_slots):
        g, r = where.get(s, (-1, -1))
        if (group_of[s], rank_of[s]) != (g, r):
            raise ValueError(
                f"PrefixGroups.group_of[{s}], rank_of[{s}] = {group_of[s]}, {rank_of[s]}: they "
                f"must say where slot {s} sits in members ({g}, {r}; -1, -1 for none)"
            )
    for s, (g, _) in where.items():
        pages, leader = int(shared[g]), members[g, 0]
        if lens[s] <= 0:
            raise ValueError(f"slot {s} of group {g} is inactive (kv_len {lens[s]})")
        if pages * page_size > lens[s] - 1:
            raise ValueError(
                f"group {g} shares {pages} pages ({pages * page_size} tokens) but member {s} "
                f"has kv_len {lens[s]}: the shared pages must lie below its new token at "
                f"position kv_len - 1"
            )
        if not np.array_equal(table[s, :pages], table[leader, :pages]):
            raise ValueError(
                f"member {s} of group {g} does not hold the group's {pages} shared pages: its "
                f"page table starts {table[s, :pages].tolist()}, member 0's (slot {leader}) "
                f"{table[leader, :pages].tolist()}"
            )


def _check_group_arrays(groups: PrefixGroups, num_seq_slots: int) -> None:
    if not isinstance(groups, PrefixGroups):
        raise TypeError(f"groups must be a PrefixGroups; got {type(groups).__name__}")
    _check_index("PrefixGroups.members", groups.members, 2)
    for name in ("shared_pages", "group_of", "rank_of"):
        _check_index(f"PrefixGroups.{name}", getattr(groups, name), 1)
    use = groups.use
    if getattr(use, "shape", None) != () or jnp.dtype(use.dtype) != jnp.bool_:
        raise ValueError(
            f"PrefixGroups.use must be a bool scalar; got {getattr(use, 'dtype', type(use))} "
            f"of shape {getattr(use, 'shape', None)}"
        )
    shapes = {
        "members": groups.members.shape[0],
        "shared_pages": groups.shared_pages.shape[0],
        "group_of": groups.group_of.shape[0],
        "rank_of": groups.rank_of.shape[0],
    }
    wrong = {name: n for name, n in shapes.items() if n != num_seq_slots}
    if wrong or groups.members.shape[1] == 0:
        raise ValueError(
            f"PrefixGroups needs S={num_seq_slots} groups (one per sequence slot) of at least "
            f"one member: members [S, n], shared_pages, group_of and rank_of [S]; got "
            f"members {groups.members.shape}, and first dims {shapes}"
        )


def _check_plan(plan: CascadePlan, num_seq_slots: int, pages_per_seq: int) -> None:
    size = plan.groups.members.shape[1]
    shape = getattr(plan.prefix_members, "shape", None)
    num_group_slots = shape[0] if shape else 1  # any count: `plan_cascade`'s max_groups
    want = {
        "prefix_members": (num_group_slots, size),
        "prefix_kv_lens": (num_group_slots,),
        "prefix_table": (num_group_slots, pages_per_seq),
        "back_group": (num_seq_slots,),
        "back_rank": (num_seq_slots,),
        "mine": (num_seq_slots,),
        "suffix_kv_lens": (num_seq_slots,),
        "suffix_table": (num_seq_slots, pages_per_seq),
    }
    for name, shape in want.items():
        array = getattr(plan, name)
        dtype = jnp.bool_ if name == "mine" else jnp.int32
        if getattr(array, "shape", None) != shape or jnp.dtype(array.dtype) != dtype:
            raise ValueError(
                f"CascadePlan.{name} must be {jnp.dtype(dtype).name}{list(shape)} for S="
                f"{num_seq_slots} sequence slots of {pages_per_seq} pages (`plan_cascade` of "
                f"this step); got {getattr(array, 'dtype', type(array))}"
                f"{list(getattr(array, 'shape', ()))}"
            )


def shared_prefix_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    groups: PrefixGroups,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    interpret: bool = False,
    prefix_num_splits: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`paged_decode_attention` that reads each group's shared pages once (cascade attention).

    With `groups.use`, two decode calls: the queries of each group's members over its shared
    pages (per KV head, the members' G = Hq / Hkv query heads as n * G rows of one GQA group:
    row `h * n * G + rank * G + i` is query head `h * G + i` of member `rank`), and every
    sequence over the rest of its pages; `merge_attention_states` combines them (a sequence in
    no group has an empty prefix, LSE -inf). Without `use`, one plain decode call. Both give
    `paged_decode_attention`'s result up to float rounding: the merge adds two normalized
    partials in float32, and in 16-bit dtypes each partial is rounded before it.

    Args:
      q, k_pages, v_pages, kv_lens, page_indices, sm_scale, logits_soft_cap, return_lse,
        implementation, interpret: as `paged_decode_attention` (both calls run the backend
        `implementation` resolves to for the plain call).
      groups: the step's `PrefixGroups` (`find_prefix_groups`, or built by hand and checked
        by `validate_prefix_groups`), or their `CascadePlan` (`plan_cascade`, once per step
        for all layers: the same result, less work per call).
      sliding_window: must be None: each query has its own window, so a group's queries do not
        see the same keys. (`PagedAttention` runs plain decode under a window.)
      prefix_num_splits: KV splits per group in the prefix call; None:
        `default_prefix_splits` for ceil(S / max_group_size) groups.

    Returns:
      `out` [S, Hq, D] in q's dtype, and `lse` f32[S, Hq] when `return_lse`; inactive slots
      give 0 and -inf.

    Raises:
      ValueError: as `paged_decode_attention`; for `groups` of the wrong shapes or dtypes, a
        sliding window, or more rows per KV head (`groups.max_group_size * G`) than the
        backend takes: the Mosaic GPU kernel takes those `default_max_group_size` allows
        (n * G <= 64 when it is a multiple of 8), Triton and XLA any number.
    """
    _check_kv(q, k_pages, v_pages, kv_lens, page_indices)
    if q.shape[0] != kv_lens.shape[0]:
        raise ValueError(
            f"q must have one token per sequence: q.shape[0] {q.shape[0]} != len(kv_lens) "
            f"{kv_lens.shape[0]}"
        )
    plan = groups if isinstance(groups, CascadePlan) else None
    if plan is not None:
        _check_plan(plan, kv_lens.shape[0], page_indices.shape[1])
        groups = plan.groups
    _check_group_arrays(groups, kv_lens.shape[0])
    if sliding_window is not None:
        raise ValueError(
            "shared_prefix_decode_attention takes no sliding_window: each query sees its own "
            "window, so a group's queries do not share the prefix keys; use "
            "paged_decode_attention"
        )
    _check_options(sm_scale, None, logits_soft_cap)
    if prefix_num_splits is not None and (
        not isinstance(prefix_num_splits, int) or prefix_num_splits < 1
    ):
        raise ValueError(
            f"prefix_num_splits must be None or an int >= 1; got {prefix_num_splits!r}"
        )
    num_q_heads, (_, page_size, num_kv_heads, _) = q.shape[1], k_pages.shape
    name = resolve_implementation(
        "decode",
        implementation,
        q.dtype,
        head_dim=q.shape[-1],
        page_size=page_size,
        num_seqs=q.shape[0],
        num_kv_heads=num_kv_heads,
        max_kv_len=page_indices.shape[1] * page_size,
    )
    group = num_q_heads // num_kv_heads
    most = default_max_group_size(num_q_heads, num_kv_heads)
    if name == "mosaic" and groups.max_group_size > most:
        raise ValueError(
            f"implementation='mosaic' takes groups of at most {most} members at Hq / Hkv = "
            f"{group} (the prefix call's {groups.max_group_size} * {group} rows per KV head "
            "must fit one 64-row wgmma tile); got max_group_size "
            f"{groups.max_group_size}: use default_max_group_size(Hq, Hkv) or "
            "implementation='triton'"
        )
    if prefix_num_splits is None:
        prefix_num_splits = default_prefix_splits(
            name,
            -(-q.shape[0] // groups.max_group_size),
            num_kv_heads,
            page_indices.shape[1] * page_size,
            q.shape[-1],
            q.dtype,
        )
    options = dict(
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        implementation=name,
        interpret=bool(interpret),
    )
    out, lse = _shared_prefix_jit(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        groups if plan is None else plan,
        options=tuple(sorted(options.items())),
        prefix_num_splits=prefix_num_splits,
        poison=poison_enabled(),
    )
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("options", "prefix_num_splits", "poison"))
def _shared_prefix_jit(
    q, k_pages, v_pages, kv_lens, page_indices, groups, *, options, prefix_num_splits, poison
):
    del poison  # a static key only: the kernels read it while tracing
    decode = functools.partial(paged_decode_attention, return_lse=True, **dict(options))
    args = (q, k_pages, v_pages, kv_lens, page_indices)
    if isinstance(groups, PrefixGroups):
        groups = _plan_cascade(groups, page_indices, kv_lens, page_size=k_pages.shape[1])
    return lax.cond(
        groups.use,
        lambda: _cascade(decode, q, k_pages, v_pages, groups, prefix_num_splits=prefix_num_splits),
        lambda: decode(*args),
    )


def _cascade(decode, q, k_pages, v_pages, plan: CascadePlan, *, prefix_num_splits):
    """The two decode calls of `plan` and their merge. Indices into q and the outputs are
    clamped (the decode op checks its own metadata): a garbage plan gives wrong numbers,
    never an access outside the arrays."""
    num_seq_slots, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    num_group_slots, size = plan.prefix_members.shape
    group = num_q_heads // num_kv_heads
    members = plan.prefix_members
    present = (members >= 0) & (members < num_seq_slots)

    # Prefix: each group's members' queries as the rows of each KV head, over member 0's pages.
    member_q = jnp.where(
        present[:, :, None, None], q[jnp.clip(members, 0, num_seq_slots - 1)], 0
    )  # [num_group_slots, n, Hq, D]
    prefix_q = (
        member_q.reshape(num_group_slots, size, num_kv_heads, group, head_dim)
        .transpose(0, 2, 1, 3, 4)
        .reshape(num_group_slots, num_kv_heads * size * group, head_dim)
    )
    prefix_decode, prefix = decode, dict(num_splits=prefix_num_splits)
    if decode.keywords["implementation"] == "mosaic":
        # The prefix call's splits stay unmerged: they merge with the suffix in one pass.
        prefix_decode = _mosaic_decode(decode.keywords, head_dim)
        prefix["merge"] = False
    prefix_out, prefix_lse = prefix_decode(
        prefix_q, k_pages, v_pages, plan.prefix_kv_lens, plan.prefix_table, **prefix
    )
    if prefix_lse.ndim == 2:  # merged: one state
        prefix_out, prefix_lse = prefix_out[:, None], prefix_lse[:, None]
    splits = prefix_lse.shape[1]
    p = jnp.clip(plan.back_group, 0, num_group_slots - 1)
    r = jnp.clip(plan.back_rank, 0, size - 1)
    rows = (num_group_slots, splits, num_kv_heads, size, group)
    # Each sequence's rows of its group's prefix states: [S, splits, Hkv, G(, D)].
    prefix_out = prefix_out.reshape(*rows, head_dim)[p, :, :, r]
    prefix_lse = prefix_lse.reshape(rows)[p, :, :, r]
    prefix_lse = jnp.where(plan.mine[:, None, None, None], prefix_lse, -jnp.inf)
    suffix_out, suffix_lse = decode(q, k_pages, v_pages, plan.suffix_kv_lens, plan.suffix_table)
    out, lse = merge_states(
        [suffix_out] + [prefix_out[:, s].reshape(q.shape) for s in range(splits)],
        [suffix_lse] + [prefix_lse[:, s].reshape(q.shape[:2]) for s in range(splits)],
    )
    return out.astype(q.dtype), lse


def _mosaic_decode(options: dict, head_dim: int):
    """The Mosaic decode kernel itself (`paged_decode_attention`'s checks done), so that the
    cascade can take its splits unmerged."""
    from pallas_kernels.mosaic import paged_decode  # noqa: PLC0415 - GPU only

    sm_scale = options["sm_scale"]
    return functools.partial(
        paged_decode.paged_decode_attention,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
        logits_soft_cap=options["logits_soft_cap"],
        interpret=options["interpret"],
    )
