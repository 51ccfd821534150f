"""Tensor and pipeline parallelism on torch.distributed: shards, stages, the worker, the executor.

`parallel.tensor_parallel_size = N` (or `pipeline_parallel_size = N`) makes
`LLMEngine` start the executor `parallel.executor` names (entry points of the
`kvforge.executors` group): the engine's process is rank 0 (scheduler,
allocator, sampling, shard or stage 0) and N - 1 workers hold the other parts:
processes it starts (`MultiprocExecutor`), Ray actors (`ray_executor`), or the
other processes of a torchrun launch (`torchrun_executor`). See docs/distributed.md.
"""

from .driver import DriverExecutor, DriverRunner
from .executor import MultiprocExecutor
from .group import RankGroup
from .pipeline_parallel import split_stages, stage_layers
from .tensor_parallel import HeadShard, RowParallelLinear, head_shard, shard_model

__all__ = ["DriverExecutor", "DriverRunner", "HeadShard", "MultiprocExecutor", "RankGroup", "RowParallelLinear",
           "head_shard", "shard_model", "split_stages", "stage_layers"]
