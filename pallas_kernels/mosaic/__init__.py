"""Pallas kernels lowered through Mosaic GPU (TMA copies, `wgmma`): Hopper (sm_90) only. Nothing
here imports from `pallas_kernels.triton`.

`paged_decode`: split-KV paged decode attention (`jaxpaged.paged_decode_attention`,
`implementation="mosaic"`): config, split rule, checks and launch; its body is `decode_body`,
its slot order (longest first) `slot_order`.
`ragged_prefill`: ragged paged prefill (`jaxpaged.ragged_paged_attention`,
`implementation="mosaic"`), FlashAttention-3's schedule on pages; its decode tokens run in
the decode kernel.
`pipeline`: the K/V page pipeline both bodies run (TMA page copies, V rows zeroed).
`common`: the inputs both take and their checks.
"""
