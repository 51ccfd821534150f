"""A third-party kvforge plugin with one implementation of every kind, written
against `kvforge.core` alone:

* `plain-torch` (attention_backend): one padded SDPA call per step, float or int8 KV.
* `free-stack` (block_allocator): a stack of free blocks, no prefix caching.
* `shortest-prompt` (scheduler_policy): short prompts first.
* `int4_unpacked` (quantizer): 4-bit codes in int8 bytes, for the KV cache.
* `last-follower` (speculative_proposer): drafts what followed the last token before.
* `choices` (structured_output): the output is one of a request's choices.
"""

from kvforge.core import hookimpl

from .allocator import FreeStackAllocator
from .attention import PlainTorchAttentionBackend
from .policy import ShortestPromptPolicy
from .proposer import LastFollowerProposer
from .quantizer import Int4UnpackedQuantizer
from .structured import ChoiceBackend

IMPLEMENTATIONS = [PlainTorchAttentionBackend, FreeStackAllocator, ShortestPromptPolicy,
                   Int4UnpackedQuantizer, LastFollowerProposer, ChoiceBackend]


@hookimpl
def kvforge_implementations():
    return IMPLEMENTATIONS
