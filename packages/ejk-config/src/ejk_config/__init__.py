"""msgspec config carriers, stable hashing and device fingerprints for ejk kernels."""

__all__: list[str] = []
