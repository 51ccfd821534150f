"""How to pick each next token, and when a request stops.

The names and meanings follow vLLM's `SamplingParams`, so users can move
between the two without relearning them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.core import RequestError

from .structured_outputs_params import StructuredOutputsParams

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
LOGIT_BIAS_BOUND = 100  # OpenAI's: a bias lies in [-100, 100]

# torch.Generator takes a 64-bit seed; sample i of n adds 1_000_003 * i, which stays in range.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request; checked on construction.

    * `temperature` 0 means greedy (argmax); otherwise logits are divided by it.
      Below `GREEDY_BELOW` it is greedy too, as in vLLM: dividing by so small a
      number overflows float32 logits to infinities.
    * `top_k` keeps the k most likely tokens (0 or -1: all); `top_p` keeps the
      smallest set whose probability reaches p; `min_p` drops tokens less likely
      than `min_p` times the most likely one.
    * `logit_bias` maps token ids to a number in [-100, 100] added to that
      token's logit before anything else (temperature, penalties, masks), as
      OpenAI and vLLM do: a small bias nudges, -100 in effect bans the token and
      100 in effect forces it. Keys may be ints or their decimal strings (OpenAI
      sends strings); they must lie in the model's vocabulary (the engine checks).
    * `repetition_penalty` (> 0, 1 = off) divides positive logits and multiplies
      negative ones of every token seen in the prompt or output;
      `presence_penalty` subtracts a constant from every token generated so far,
      `frequency_penalty` subtracts it once per occurrence.
    * `seed` gives the request its own random stream, so it samples the same
      tokens whatever else shares its batch.
    * Stopping: `max_tokens` new tokens at most; `stop_token_ids` and the
      model's EOS (unless `ignore_eos`) end it, but not before `min_tokens`;
      `stop` strings end it too and are cut from the text.
    * `logprobs`: also return the log-probabilities of the `logprobs` most
      likely tokens at each step (and of the chosen one); None for none.
    * `prompt_logprobs`: also return, for every prompt token but the first, its
      log-probability given the tokens before it (with its rank) and those of the
      `prompt_logprobs` most likely tokens there (`RequestOutput.prompt_logprobs`);
      None for none. Both are the model's raw distribution: before logit bias,
      penalties, temperature and masks.
    * `n` samples per prompt; they share the prompt's KV blocks.
    * `detokenize=False` leaves the output text empty (token ids only) and skips
      the per-token decoding; `stop` strings need the text, so they need it on.
    * `speculative=False` opts this request out of speculative decoding (when
      the engine has a `speculative.proposer`); its output is the same either way.
    * `structured_outputs` (a `StructuredOutputsParams`, or a dict of its fields)
      constrains the output to a JSON schema, regex, choice or grammar; the
      output ends (EOS) exactly when it is complete, so `ignore_eos` and
      `min_tokens` do not combine with it. `max_tokens` may still cut it short
      (finish reason "length").
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    speculative: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_id_key(key): bias for key, bias in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        problems = self.problems()
        if problems:
            raise RequestError("invalid sampling parameters: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid setting, each with the valid range."""
        found = []

        def check(ok: bool, text: str) -> None:
            if not ok:
                found.append(text)

        check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(_is_num(self.temperature) and self.temperature >= 0,
              f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
              f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
              f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}")
        check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        check(self.seed is None or _is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED,
              f"seed must be None or an integer in [{MIN_SEED}, {MAX_SEED}] (a 64-bit seed), got {self.seed!r}")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0,
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if _is_int(self.max_tokens) and _is_int(self.min_tokens):
            check(self.min_tokens <= self.max_tokens,
                  f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
              f"logprobs must be None or an integer >= 0 (how many top tokens), got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
              "prompt_logprobs must be None or an integer >= 0 (how many top tokens per prompt position), "
              f"got {self.prompt_logprobs!r}")
        found += logit_bias_problems(self.logit_bias)
        check(isinstance(self.speculative, bool), f"speculative must be True or False, got {self.speculative!r}")
        structured = self.structured_outputs
        check(structured is None or isinstance(structured, StructuredOutputsParams),
              f"structured_outputs must be a StructuredOutputsParams, a dict of its fields or None, got {structured!r}")
        if structured is not None:
            check(not self.ignore_eos, "ignore_eos cannot be combined with structured_outputs: the output ends "
                  "(EOS) exactly when it is complete; drop ignore_eos")
            check(self.min_tokens == 0, f"min_tokens ({self.min_tokens}) cannot be combined with structured_outputs: "
                  "the grammar decides where the output ends; set min_tokens=0")
        check(self.detokenize or not self.stop,
              f"stop strings {self.stop!r} need the output text: set detokenize=True or use stop_token_ids")
        return found

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def logit_bias_problems(logit_bias) -> list[str]:
    """What is wrong with a `logit_bias`, each naming its key and the valid range."""
    if logit_bias is None:
        return []
    if not isinstance(logit_bias, dict):
        return [f"logit_bias must be a dict of token id to bias, or None, got {logit_bias!r}"]
    found = []
    for key, bias in logit_bias.items():
        if not (_is_int(key) and key >= 0):
            found.append(f"logit_bias key {key!r} is not a token id: use a non-negative integer "
                         "(or its decimal string, as OpenAI sends it)")
        elif not (_is_num(bias) and -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND):
            found.append(f"logit_bias[{key}] must be a number in [-{LOGIT_BIAS_BOUND}, {LOGIT_BIAS_BOUND}], "
                         f"got {bias!r}")
    return found


def _token_id_key(key):
    """A decimal string key (OpenAI's JSON has string keys) as its int; anything else as it is."""
    return int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
