"""A throwaway step at engine start: on a GPU as large as any step the
scheduler may plan, on a CPU one short sequence.

The first large step of an engine pays for memory its activations touch for the
first time (page faults, the heap growing) and for kernels meeting a new shape;
without a warm-up that lands on the first requests' time to first token. On a
GPU such a step costs little and vLLM runs one at start for the same reason (its
memory profiling run). On a CPU a step's time is its arithmetic, which grows
with its tokens, while what a full-size step would spare the first large
request is a few percent of that request's own step, once: there the warm-up
only shows that the model runs and meets its kernels, and costs the start-up
next to nothing (`warm_up_tokens`). The KV blocks it writes are freed unhashed,
so no later request can hit them, and the scheduler, the prefix cache and the
engine's counters never see it.
"""

from __future__ import annotations

from kvforge.core import cdiv

from .request import Request
from .sampling_params import SamplingParams
from .scheduler_output import ScheduledRequest

PROMPT_LEN = 128
"""Tokens per warm-up sequence: prompt-sized, so the attention of the step stays
cheap however large the token budget is (one 8k-token sequence would not)."""


CPU_TOKENS = 16
"""Tokens of a CPU warm-up step: one sequence, a prompt's worth for the prefill kernels."""


def warm_up_tokens(device, max_num_batched_tokens: int) -> int:
    """The warm-up step's token budget on `device` (a `torch.device`):
    `max_num_batched_tokens` on a GPU, `CPU_TOKENS` (at most that) on a CPU."""
    if device.type == "cpu":
        return min(CPU_TOKENS, max_num_batched_tokens)
    return max_num_batched_tokens


def warm_up(runner, kv, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
    """Run one prefill step of up to `max_num_batched_tokens` tokens in sequences
    of `PROMPT_LEN`, as far as the cache's free blocks allow; returns its tokens
    (0 when nothing fits)."""
    length = max(1, min(PROMPT_LEN, max_model_len, max_num_batched_tokens))
    num_seqs = min(max_num_seqs, max_num_batched_tokens // length, kv.num_free_blocks // cdiv(length, kv.block_size))
    if num_seqs <= 0:
        return 0
    params = SamplingParams(max_tokens=1)
    entries = [ScheduledRequest(Request(f"__kvforge_warmup_{i}", [0] * length, params), 0, length)
               for i in range(num_seqs)]
    admitted = []
    try:
        for entry in entries:  # sized to the free blocks, so every allocation succeeds
            kv.admit(entry.request.request_id, ())
            admitted.append(entry.request.request_id)
            kv.allocate_slots(entry.request.request_id, length)
        runner.execute(entries)
    finally:
        for request_id in admitted:
            kv.free(request_id)
    return num_seqs * length
