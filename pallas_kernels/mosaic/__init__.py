"""Pallas kernels lowered through Mosaic GPU (TMA copies, `wgmma`): Hopper (sm_90) only.

`paged_decode`: split-KV paged decode attention (`jaxpaged.paged_decode_attention`,
`implementation="mosaic"`).
"""
