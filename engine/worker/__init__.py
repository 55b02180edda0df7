"""A stage worker process: one verified shard serving its place in a ring."""
