"""What the HTTP front end needs of the model: its tokenizer and sizes. With
data-parallel replicas the API process holds no engine, so a replica sends these
once it is ready."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServedModel:
    tokenizer: object  # None for a model served by token ids only
    vocab_size: int
    max_model_len: int
    block_size: int
    root: str  # the model as configured (a directory or a built-in name)

    @classmethod
    def of(cls, engine) -> "ServedModel":
        return cls(engine.tokenizer, engine.vocab_size, engine.max_model_len, engine.kv.block_size,
                   str(engine.config.model))
