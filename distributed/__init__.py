"""Tensor parallelism on torch.distributed: parallel layers, the worker, the executor.

`parallel.tensor_parallel_size = N` makes `LLMEngine` start a `MultiprocExecutor`:
the engine's process is rank 0 (scheduler, allocator, sampling, shard 0) and
N - 1 worker processes hold the other shards. See docs/distributed.md.
"""

from .executor import MultiprocExecutor, DriverRunner
from .group import RankGroup
from .tensor_parallel import HeadShard, RowParallelLinear, head_shard, shard_model

__all__ = ["HeadShard", "MultiprocExecutor", "RowParallelLinear", "RankGroup", "DriverRunner",
           "head_shard", "shard_model"]
