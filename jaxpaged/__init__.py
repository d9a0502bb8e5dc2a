"""jaxpaged: paged attention for JAX on NVIDIA GPUs, as Pallas kernels.

Ops (one layer's page pool `k_pages, v_pages [P, page_size, Hkv, D]`):
  ragged_paged_attention  prefill, chunked prefill and decode tokens in one ragged batch
  paged_decode_attention  one token per sequence, split-KV
  append_kv               write a step's new K/V into the pages
  kv_slots, write_kv      the same in two parts: the tokens' pool slots once per step, then
                          one plain scatter per layer
  copy_pages              copy whole pages (a forked sequence's private last page)
  merge_attention_states  combine attention over two disjoint key sets
Shared prefixes (cascade attention): shared_prefix_decode_attention is decode that reads the
  pages a group of sequences shares once per group, over PrefixGroups from find_prefix_groups
  (jittable, once per step; validate_prefix_groups checks hand-built ones on the host;
  default_max_group_size is the largest group every backend takes), or over the CascadePlan
  plan_cascade builds from them once per step for every layer.
State: PagePool with create_pool / reserve / truncate / fork / attach / release /
  batch_metadata (pages shared between sequences are reference-counted) and retain / drop
  (pages held without a slot, as a prefix cache holds them); validate_fork checks a fork on
  the host.
Layer: PagedAttention (Flax NNX, GQA + RoPE over one layer's pages) with StepMetadata and
  RopeScaling.
"""

from jaxpaged.attention import (
    available_implementations,
    merge_attention_states,
    paged_decode_attention,
    quiet_triton_deprecation,
    ragged_paged_attention,
    resolve_implementation,
)
from jaxpaged.batch import validate_batch
from jaxpaged.kv_cache import append_kv, copy_pages, kv_slots, write_kv
from jaxpaged.layers import (
    TP_AXIS,
    PagedAttention,
    RopeScaling,
    StepMetadata,
    add_rms_norm,
    apply_rope,
    fuse_qkv,
    rms_norm,
    rope_append,
    rope_frequencies,
    split_qkv,
    tensor_parallel_size,
)
from jaxpaged.page_pool import (
    PagePool,
    attach,
    batch_metadata,
    create_pool,
    drop,
    fork,
    num_free_pages,
    release,
    reserve,
    retain,
    truncate,
    validate_fork,
)
from jaxpaged.shared_prefix import (
    CascadePlan,
    PrefixGroups,
    default_max_group_size,
    find_prefix_groups,
    plan_cascade,
    shared_prefix_decode_attention,
    validate_prefix_groups,
)

__all__ = [
    "TP_AXIS",
    "CascadePlan",
    "PagePool",
    "PagedAttention",
    "PrefixGroups",
    "RopeScaling",
    "StepMetadata",
    "add_rms_norm",
    "rms_norm",
    "rope_append",
    "append_kv",
    "apply_rope",
    "attach",
    "available_implementations",
    "batch_metadata",
    "copy_pages",
    "create_pool",
    "default_max_group_size",
    "drop",
    "find_prefix_groups",
    "plan_cascade",
    "fork",
    "fuse_qkv",
    "kv_slots",
    "merge_attention_states",
    "num_free_pages",
    "paged_decode_attention",
    "quiet_triton_deprecation",
    "ragged_paged_attention",
    "rope_frequencies",
    "release",
    "reserve",
    "retain",
    "shared_prefix_decode_attention",
    "split_qkv",
    "tensor_parallel_size",
    "truncate",
    "resolve_implementation",
    "validate_batch",
    "validate_fork",
    "validate_prefix_groups",
    "write_kv",
]
__version__ = "0.1.0"
