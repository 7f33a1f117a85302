"""Pallas TPU block-sparse (splash-style) attention kernels and their masks."""

__all__: list[str] = []
