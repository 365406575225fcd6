"""I/O: shard mappings and row gathers (backends live in their own modules)."""
