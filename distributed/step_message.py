"""One step's plan as the driver broadcasts it to the workers: two int64 tensors.

The driver schedules; a worker only needs what its model call reads: the
step's tokens and positions, the `AttentionBatch`, the copy-on-write block
copies to apply first, and the rows whose logits are sampled (ranks that hold a
vocabulary slice of the LM head compute those rows' logits). They travel as a fixed-size header (command and sizes)
then one flat payload, so a step costs two broadcasts whatever the batch, and
no pickling. A `STOP` header ends a worker's loop; a `REPORT` header asks every
rank for its timings (`timing.gather_timings`). With LoRA adapters, a step also
carries each token's adapter slot, and a `LORA` message (`send_lora`) tells every
rank to load an adapter's directory into a slot before the steps that use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.core import AttentionBatch

from .group import RankGroup

STOP, STEP, REPORT, LORA = 0, 1, 2, 3
HEADER_SIZE = 9  # command, tokens, sequences, block-table columns, block copies, logit rows, max query len,
#                  max seq len, whether token slots follow (a LORA message: command, slot, bytes)


@dataclass
class StepMessage:
    """What a worker needs to run one step: the model inputs, the block copies and the sampled rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    copies: list[tuple[int, int]]
    logit_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    token_slots: torch.Tensor | None = None  # each token's LoRA slot (-1: the base model); None: no adapter


@dataclass(frozen=True)
class LoRALoad:
    """Load the adapter in directory `path` (whose weights' fingerprint is `fingerprint`) into `slot`."""

    slot: int
    path: str
    fingerprint: str


def send_command(group: RankGroup, command: int) -> None:
    """Broadcast a header without a step: `STOP` or `REPORT`."""
    group.broadcast(torch.tensor([command] + [0] * (HEADER_SIZE - 1), dtype=torch.int64, device=group.device))


def send_step(group: RankGroup, message: StepMessage) -> None:
    """Broadcast `message` from rank 0."""
    batch = message.batch
    tokens, seqs = message.input_ids.shape[0], batch.seq_lens.shape[0]
    lora = message.token_slots is not None
    header = [STEP, tokens, seqs, batch.block_table.shape[1], len(message.copies), message.logit_rows.numel(),
              batch.max_query_len, batch.max_seq_len, int(lora)]
    copies = torch.tensor(message.copies, dtype=torch.int64).reshape(-1, 2).t().reshape(-1)
    device = group.device
    parts = [message.input_ids, message.positions, batch.query_start_loc, batch.seq_lens, batch.context_lens,
             batch.block_table.reshape(-1), batch.slot_mapping, copies.to(device), message.logit_rows]
    if lora:
        parts.append(message.token_slots)
    payload = torch.cat([p.to(device=device, dtype=torch.int64) for p in parts])
    group.broadcast(torch.tensor(header, dtype=torch.int64, device=device))
    group.broadcast(payload)


def send_lora(group: RankGroup, load: LoRALoad) -> None:
    """Broadcast `load` from rank 0: the header, then the path and fingerprint as bytes."""
    data = f"{load.path}\0{load.fingerprint}".encode()
    header = [LORA, load.slot, len(data)] + [0] * (HEADER_SIZE - 3)
    group.broadcast(torch.tensor(header, dtype=torch.int64, device=group.device))
    group.broadcast(torch.tensor(list(data), dtype=torch.int64, device=group.device))


def receive(group: RankGroup, block_size: int) -> tuple[int, StepMessage | LoRALoad | None]:
    """The next command from rank 0, with its step when it is `STEP`, its load when `LORA`."""
    header = group.broadcast(torch.empty(HEADER_SIZE, dtype=torch.int64, device=group.device)).tolist()
    command, tokens, seqs, cols, num_copies, num_rows, max_query_len, max_seq_len, lora = header
    if command == LORA:
        data = group.broadcast(torch.empty(seqs, dtype=torch.int64, device=group.device))
        path, _, fingerprint = bytes(data.tolist()).decode().partition("\0")
        return command, LoRALoad(tokens, path, fingerprint)
    if command != STEP:
        return command, None
    sizes = [tokens, tokens, seqs + 1, seqs, seqs, seqs * cols, tokens, 2 * num_copies, num_rows, tokens * lora]
    payload = group.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=group.device))
    (input_ids, positions, query_start_loc, seq_lens, context_lens, table, slots, copies, rows,
     token_slots) = payload.split(sizes)
    batch = AttentionBatch(
        query_start_loc=query_start_loc.int(), seq_lens=seq_lens.int(), context_lens=context_lens.int(),
        block_table=table.reshape(seqs, cols).int(), slot_mapping=slots.clone(), block_size=block_size,
        max_query_len=max_query_len, max_seq_len=max_seq_len)
    pairs = copies.reshape(2, -1).t().tolist()
    return STEP, StepMessage(input_ids.clone(), positions.clone(), batch, [(s, d) for s, d in pairs], rows.clone(),
                             token_slots.clone() if lora else None)
