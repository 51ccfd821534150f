"""`last-follower`: the speculative proposer of docs/writing_plugins.md, installable."""

from kvforge.core import ConfigError, DraftProposal, SpeculativeProposer


class LastFollowerProposer(SpeculativeProposer):
    """Drafts the token that followed the last earlier occurrence of the request's
    final token, then repeats from the drafted token. Deterministic (no `probs`):
    the engine verifies every draft, so a poor guess costs speed, never correctness.

    Option (`speculative.options`): `window`, how many of the request's last tokens
    to search (default 256)."""

    name = "last-follower"
    api_version = (1, 4)

    def __init__(self, **options):
        self.window = options.pop("window", 256)
        if options:
            raise ConfigError(f"last-follower has no option {sorted(options)}; valid options: window")
        if not isinstance(self.window, int) or self.window < 2:
            raise ConfigError(f"last-follower: window = {self.window!r} must be an int >= 2 "
                              "(a token and one earlier token to match)")

    def propose(self, requests, num_tokens):
        proposals = []
        for request in requests:  # exactly one proposal per request, in order
            tokens = list(request.token_ids)[-self.window:]
            drafts = []
            for _ in range(num_tokens):
                seen = tokens[:-1]
                if not tokens or tokens[-1] not in seen:
                    break
                follower = tokens[len(seen) - seen[::-1].index(tokens[-1])]
                drafts.append(follower)
                tokens.append(follower)
            proposals.append(DraftProposal(drafts))
        return proposals
