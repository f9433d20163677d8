"""ckptdb's benchmarks: ``python -m benchmarks`` (see README, "Performance")."""
