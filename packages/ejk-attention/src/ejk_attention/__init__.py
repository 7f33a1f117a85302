"""One attention API over every ejk backend: XLA reference, Triton, Pallas, sharding, ring attention and the `ejk` CLI."""

__all__: list[str] = []
