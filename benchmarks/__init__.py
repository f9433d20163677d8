"""ckptdb's benchmarks: ``python -m benchmarks`` (see docs/performance.md)."""
