"""`choices`: a structured_output backend for `choice` specs, a trie of the choices'
bytes walked token by token."""

from kvforge.core import Grammar, StructuredOutputBackend, StructuredOutputError


class ChoiceGrammar(Grammar):
    """The output so far is one byte string. A token is allowed when the bytes it
    adds keep the output a prefix of some choice; EOS when the output is a whole
    choice. One entry per accepted token makes rolling back a slice."""

    def __init__(self, vocabulary, choices):
        self.vocabulary = vocabulary
        self.choices = choices
        self.eos = set(vocabulary.eos_token_ids)
        self.outputs = [b""]  # the output after each accepted token; None once EOS is accepted

    def allows(self, token_id):
        output = self.outputs[-1]
        if output is None or not 0 <= token_id < len(self.vocabulary.token_bytes):
            return False
        if token_id in self.eos:
            return output in self.choices
        piece = self.vocabulary.token_bytes[token_id]
        if not piece or token_id in self.vocabulary.special_token_ids:
            return False
        return any(choice.startswith(output + piece) for choice in self.choices)

    def accept_tokens(self, token_ids):
        for done, token_id in enumerate(token_ids):
            if not self.allows(token_id):
                self.rollback(done)  # guarantee 2: a refused call changes nothing
                return False
            eos = token_id in self.eos
            self.outputs.append(None if eos else self.outputs[-1] + self.vocabulary.token_bytes[token_id])
        return True

    def validate_tokens(self, token_ids):
        accepted = 0
        for token_id in token_ids:
            if not self.accept_tokens([token_id]):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted

    def rollback(self, num_tokens):
        if num_tokens > len(self.outputs) - 1:
            raise StructuredOutputError(f"cannot roll back {num_tokens} tokens: {len(self.outputs) - 1} were accepted")
        if num_tokens:
            del self.outputs[-num_tokens:]

    def fill_bitmask(self, bitmask, row):
        bits = [0] * bitmask.shape[-1]
        for token_id in range(len(self.vocabulary.token_bytes)):
            if self.allows(token_id):
                bits[token_id // 32] |= 1 << (token_id % 32)
        # the layout is int32: a word with bit 31 set is negative
        bitmask[row] = bitmask.new_tensor([word - (1 << 32) if word >= 1 << 31 else word for word in bits])

    def is_terminated(self):
        return self.outputs[-1] is None


class ChoiceBackend(StructuredOutputBackend):
    """Compiles `choice` specs (the output is exactly one of the given strings); refuses the other kinds."""

    name = "choices"
    api_version = (1, 4)
    spec_kinds = frozenset({"choice"})  # one of kvforge.core.SPEC_KINDS

    def compile(self, spec):
        reasons = self.spec_unsupported_reasons(spec)
        if reasons:
            raise StructuredOutputError("; ".join(reasons))
        if not spec.value:
            raise StructuredOutputError("a choice spec needs at least one choice")
        return ChoiceGrammar(self.vocabulary, tuple(choice.encode("utf-8") for choice in spec.value))
