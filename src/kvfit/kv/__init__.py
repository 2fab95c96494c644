"""KV cache capacity: the spec (bytes per block, layout), the planner, the block pool. No torch."""
