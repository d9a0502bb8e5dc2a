"""Pallas kernels behind `jaxpaged`'s attention ops: `triton/` and `mosaic/` lowerings."""
