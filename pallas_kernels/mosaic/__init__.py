"""Pallas kernels lowered through Mosaic GPU (TMA copies, `wgmma`): Hopper (sm_90) only.

`paged_decode`: split-KV paged decode attention (`jaxpaged.paged_decode_attention`,
`implementation="mosaic"`).
`ragged_prefill`: ragged paged prefill (`jaxpaged.ragged_paged_attention`,
`implementation="mosaic"`), FlashAttention-3's schedule on pages.
`common`: the inputs both take and their checks.
"""
