"""Turn one scheduler step into one model call.

The scheduled requests' new tokens are flattened into a single ragged batch
(no padding); positions, `query_start_loc`, `seq_lens` and the slot mapping are
computed with tensor ops from the per-request lengths and the block table, so
no Python loop runs over tokens. `plan` is called once per step; logits are
computed only for the rows that are sampled: a sampling request's last known
token and each of its draft tokens (speculative decoding verifies them all in
this one forward pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.core import AttentionBatch

from .decode_inputs import DecodeInputs, is_decode
from .request import token_slice
from .scheduler_output import ScheduledRequest


class ModelRunner:
    """Owns the per-layer KV caches of one model."""

    def __init__(self, model, kv, kv_caches: list[torch.Tensor], block_size: int, device: torch.device):
        self.model = model
        self.kv = kv
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.decode_inputs = DecodeInputs(block_size)  # decode steps' inputs, in buffers kept across steps

    def build_batch(self, scheduled: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """`(input_ids, positions, batch)` for the scheduled requests, in order.

        A step of decodes (one known token per request and its drafts, if any: the
        common case) is written into buffers kept across steps (`DecodeInputs`):
        no tensor is made, and the tensors returned are valid until the next call.
        Any other step gathers per-request figures in one pass and computes the
        token-level arrays (positions, slots) with tensor ops (`general_batch`)."""
        if is_decode(scheduled):
            tables = self.kv.live_block_tables([entry.request.request_id for entry in scheduled])
            return self.decode_inputs.build(scheduled, tables, self.device)
        return self.general_batch(scheduled)

    def general_batch(self, scheduled: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """`build_batch` for any step, in fresh tensors."""
        tokens: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for entry in scheduled:
            known_end = entry.start + entry.num_tokens - len(entry.draft_token_ids)
            tokens += token_slice(entry.request, entry.start, known_end)
            tokens += entry.draft_token_ids
            starts.append(entry.start)
            lens.append(entry.num_tokens)
        size = self.block_size
        tables = self.kv.live_block_tables([entry.request.request_id for entry in scheduled])
        width = max(map(len, tables))
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        max_query_len = max(lens)
        context_lens = torch.tensor(starts, dtype=torch.int32)
        query_lens = torch.tensor(lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        seq_lens = context_lens + query_lens.int()
        seq_of_token = torch.repeat_interleave(query_lens)
        # A token's position: its index in the flat batch, shifted by its sequence's (context - start).
        shift = context_lens.long() - query_start_loc[:-1].long()
        positions = torch.arange(len(tokens)) + shift[seq_of_token]
        slot_mapping = block_table[seq_of_token, positions // size].long() * size + positions % size
        device = self.device
        batch = AttentionBatch(
            query_start_loc=query_start_loc.to(device),
            seq_lens=seq_lens.to(device),
            context_lens=context_lens.to(device),
            block_table=block_table.to(device),
            slot_mapping=slot_mapping.to(device),
            block_size=size,
            max_query_len=max_query_len,
            max_seq_len=max(s + n for s, n in zip(starts, lens)),
        )
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        return input_ids, positions.to(device), batch

    def apply_block_copies(self) -> int:
        """Copy-on-write: copy each pending (src, dst) block in every layer's cache."""
        copies = self.kv.pop_pending_copies()
        copy_blocks(self.kv_caches, copies, self.device)
        return len(copies)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                output_rows: torch.Tensor | None = None, token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The model's hidden states for one step's batch (only `output_rows`' when
        given): `plan` once, then `forward`. `token_slots` is each token's LoRA slot
        (-1: the base model; None: no adapter in this step)."""
        plan = self.model.plan(batch) if output_rows is None else self.model.plan(batch, output_rows)
        lora = getattr(self.model, "lora", None)
        if lora is not None:
            lora.set_step(token_slots, output_rows)
        return self.model.forward(input_ids, positions, self.kv_caches, plan)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest], lora_slots: Sequence[int] | None = None) -> torch.Tensor:
        """Run one step; float32 logits of the last `entry.num_prompt_logit_rows +
        entry.num_logit_rows` new tokens of every scheduled entry, entry after entry.
        `lora_slots` gives each entry's LoRA slot (-1: the base model; None: no
        entry runs an adapter)."""
        self.apply_block_copies()
        return self.run(scheduled, *self.build_batch(scheduled), lora_slots)

    @torch.inference_mode()
    def execute_next(self, scheduled: Sequence[ScheduledRequest], tokens: Sequence[int],
                     lora_slots: Sequence[int] | None = None) -> torch.Tensor:
        """The decode step after the last `execute` or `execute_next` of the same
        plain decode entries (one token each, no drafts), each request fed its token
        in `tokens` one position further on (a multi-step burst, `decode_bursts`;
        the blocks those positions land in must be reserved); its logits as `execute`'s."""
        return self.run(scheduled, *self.decode_inputs.advance(tokens, self.device), lora_slots)

    @torch.inference_mode()
    def greedy_burst(self, scheduled: Sequence[ScheduledRequest], steps: int, stop_ids: list[int],
                     max_seconds: float) -> list[list[int]] | None:
        """Up to `steps` greedy decode steps of plain decode entries (their blocks
        reserved) in one call of the model's C++ decoder stack with its LM head
        (`CppDecoderStack.greedy_burst`): each step's greedy tokens, entry by entry,
        ending after a step in which every entry sampled one of `stop_ids` or which
        brought the call's time to `max_seconds`, and before one whose logits are not
        finite. None where the model has no such stack or
        it cannot run this step (the caller then runs the steps one by one)."""
        return self._cpp_burst("greedy_burst", scheduled, steps, stop_ids, max_seconds)

    @torch.inference_mode()
    def sampled_burst(self, scheduled: Sequence[ScheduledRequest], steps: int, stop_ids: list[int],
                      max_seconds: float, settings: tuple, u: torch.Tensor, history: tuple) -> list[list[int]] | None:
        """`greedy_burst` with each entry's token drawn by the sampler's C++ draw
        after its penalties (`CppDecoderStack.sampled_burst`: `settings` as
        `sampler.row_settings` gives them, `u` float64 `[steps, entries]`, `history`
        as `decode_bursts.penalty_history`)."""
        return self._cpp_burst("sampled_burst", scheduled, steps, stop_ids, max_seconds, settings, u, history)

    @property
    def bursts_in_cpp(self) -> bool:
        """Whether the model's C++ decoder stack runs its LM head, so that a burst
        can be one C++ call (a step's plan may still be refused: another
        attention backend, a quantized KV cache)."""
        stack = getattr(self.model, "decoder_stack", None)
        return stack is not None and stack.head_reason is None

    def _cpp_burst(self, method: str, scheduled: Sequence[ScheduledRequest], steps: int, stop_ids: list[int],
                   max_seconds: float, *sampling) -> list[list[int]] | None:
        if not self.bursts_in_cpp:
            return None
        stack = self.model.decoder_stack
        self.apply_block_copies()
        input_ids, positions, batch = self.build_batch(scheduled)
        return getattr(stack, method)(input_ids, positions, self.kv_caches, self.model.plan(batch), steps, stop_ids,
                                      max_seconds, *sampling)

    def run(self, scheduled: Sequence[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
            batch: AttentionBatch, lora_slots: Sequence[int] | None) -> torch.Tensor:
        """The model over a built batch of `scheduled`; the logits `execute` returns."""
        token_slots = token_slots_of(scheduled, lora_slots)
        rows = logit_rows(scheduled)
        if len(rows) == input_ids.shape[0]:  # rows are increasing: as many as tokens means every token
            hidden = self.forward(input_ids, positions, batch, token_slots=token_slots)
        else:
            wanted = torch.tensor(rows, dtype=torch.int64, device=self.device)
            if getattr(self.model, "computes_output_rows_only", False):  # its last layer runs on these rows only
                hidden = self.forward(input_ids, positions, batch, wanted, token_slots)
            else:
                hidden = self.forward(input_ids, positions, batch, token_slots=token_slots)[wanted]
        if not rows:
            return hidden.new_zeros((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden).float()


def token_slots_of(scheduled: Sequence[ScheduledRequest], lora_slots: Sequence[int] | None) -> torch.Tensor | None:
    """Each flat token's LoRA slot (a CPU int64 tensor: the layers' segments are
    planned on the CPU) from each entry's; None when no entry runs an adapter."""
    if lora_slots is None:
        return None
    counts = torch.tensor([entry.num_tokens for entry in scheduled])
    return torch.tensor(lora_slots, dtype=torch.int64).repeat_interleave(counts)


def logit_rows(scheduled: Sequence[ScheduledRequest]) -> list[int]:
    """Rows of the step's flat batch whose logits are needed: an entry with `c`
    logit rows needs its last `c` tokens. A loop over requests (c is 1 plus its
    drafts, or the prefill rows that score a prompt for prompt logprobs), not over tokens."""
    rows: list[int] = []
    end = 0
    for entry in scheduled:
        end += entry.num_tokens
        count = entry.num_logit_rows + entry.num_prompt_logit_rows
        if count:
            rows.extend(range(end - count, end))
    return rows


def copy_blocks(kv_caches: Sequence[torch.Tensor], copies: Sequence[tuple[int, int]], device: torch.device) -> None:
    """Copy block `src` to block `dst` in every layer's cache, for each `(src, dst)`."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=device)
    dst = torch.tensor([d for _, d in copies], device=device)
    for cache in kv_caches:
        cache[dst] = cache[src]
