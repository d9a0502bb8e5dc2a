"""Pallas kernels lowered through Triton (sm80+; interpret mode on machines without a GPU)."""
