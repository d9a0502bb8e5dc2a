"""Host-side checks of a step's dynamic batch metadata.

Inside `jit` the ops cannot raise on data, so they clamp every index instead (bad metadata may
give wrong numbers, never an out-of-bounds access). Call `validate_batch` on the host, where the
metadata is built, to get a clear error instead.
"""

from __future__ import annotations

import numpy as np


def validate_batch(q, k_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    """Raise `ValueError` naming the first rule the batch metadata breaks.

    Args (as `ragged_paged_attention`; only shapes of `q` [T, Hq, D] and `k_pages`
    [P, page_size, Hkv, D] are read; the metadata must be concrete):
      kv_lens i32[S], page_indices i32[S, pages_per_seq], cu_q_lens i32[S+1], num_seqs.

    Rules, for every live sequence s < num_seqs:
      0 <= num_seqs <= S; cu_q_lens[0] == 0; cu_q_lens non-decreasing up to num_seqs;
      cu_q_lens[num_seqs] <= T; q_len <= kv_len <= pages_per_seq * page_size; the page ids
      covering positions [0, kv_len) lie in [0, P); and no page that receives a new token is
      used by another live sequence (a write there would corrupt it).
    """
    num_tokens = q.shape[0]
    num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
    kv_lens = np.asarray(kv_lens)
    page_indices = np.asarray(page_indices)
    cu = np.asarray(cu_q_lens)
    num_seq_slots, pages_per_seq = page_indices.shape
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    if not 0 <= n <= num_seq_slots:
        raise ValueError(f"num_seqs must lie in [0, S={num_seq_slots}]; got {n}")
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0] must be 0; got {cu[0]}")
    q_lens = np.diff(cu[: n + 1])
    if np.any(q_lens < 0):
        s = int(np.argmax(q_lens < 0))
        raise ValueError(f"cu_q_lens must be non-decreasing: cu_q_lens[{s + 1}] < cu_q_lens[{s}]")
    if cu[n] > num_tokens:
        raise ValueError(
            f"cu_q_lens[num_seqs={n}] = {cu[n]} exceeds the T={num_tokens} tokens of q"
        )
    capacity = pages_per_seq * page_size
    owner: dict[int, int] = {}
    written: dict[int, int] = {}
    for s in range(n):
        q_len, kv_len = int(q_lens[s]), int(kv_lens[s])
        if q_len > kv_len:
            raise ValueError(
                f"sequence {s}: q_len {q_len} > kv_len {kv_len} (kv_lens counts the new tokens)"
            )
        if kv_len > capacity:
            raise ValueError(
                f"sequence {s}: kv_len {kv_len} exceeds the page table's capacity "
                f"pages_per_seq * page_size = {capacity}"
            )
        used = page_indices[s, : -(-kv_len // page_size)]
        bad = (used < 0) | (used >= num_pages)
        if np.any(bad):
            j = int(np.argmax(bad))
            raise ValueError(
                f"sequence {s}: page_indices[{s}, {j}] = {used[j]} is outside [0, P={num_pages})"
            )
        for page in used.tolist():
            owner.setdefault(page, s)
        first_new = (kv_len - q_len) // page_size
        for page in used[first_new:].tolist() if q_len else ():
            written[page] = s
    for s in range(n):
        kv_len = int(kv_lens[s])
        for page in page_indices[s, : -(-kv_len // page_size)].tolist():
            if page in written and written[page] != s:
                raise ValueError(
                    f"page {page} receives new tokens of sequence {written[page]} but is also "
                    f"used by sequence {s}"
                )
