"""The pool shape and the observable-state snapshot shared by
the block allocator checks and the random-operations model `pool_machine`
(here, so that no check module imports another)."""

NUM_BLOCKS = 8
BLOCK_SIZE = 4


def snapshot(pool) -> tuple:
    """Everything observable about the pool except the lookup counters."""
    usage = pool.usage()
    return (tuple(pool.ref_count(b) for b in range(pool.num_blocks)),
            tuple(pool.block_hash_of(b) for b in range(pool.num_blocks)),
            usage.free, usage.cached, usage.in_use)
