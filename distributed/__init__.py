"""Tensor and pipeline parallelism on torch.distributed: shards, stages, the worker, the executor.

`parallel.tensor_parallel_size = N` (or `pipeline_parallel_size = N`) makes
`LLMEngine` start a `MultiprocExecutor`: the engine's process is rank 0
(scheduler, allocator, sampling, shard or stage 0) and N - 1 worker processes
hold the other parts. See docs/distributed.md.
"""

from .executor import DriverRunner, MultiprocExecutor
from .group import RankGroup
from .pipeline_parallel import split_stages, stage_layers
from .tensor_parallel import HeadShard, RowParallelLinear, head_shard, shard_model

__all__ = ["DriverRunner", "HeadShard", "MultiprocExecutor", "RankGroup", "RowParallelLinear", "head_shard",
           "shard_model", "split_stages", "stage_layers"]
