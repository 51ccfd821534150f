"""The request bodies the server accepts, as pydantic models.

Field names and meanings follow OpenAI's API with vLLM's extensions (`top_k`,
`min_p`, `ignore_eos`, `priority`, `cache_salt`, ...). An unknown field is
refused (400 naming it) rather than ignored, so a misspelt setting never
silently has no effect. Types are strict (`true` is not a token id, `"5"` is not
a count), so what the schema at /openapi.json allows is exactly what is accepted;
rules between fields are stated there too (`dependentSchemas`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from kvforge.core import RequestError
from kvforge.engine.sampling_params import LOGIT_BIAS_BOUND, SamplingParams

from .request_config import REQUEST_CONFIG

from .structured_protocol import ResponseFormat, StructuredOutputsBody, structured_params
from .tool_call_format import ToolCallReader, hermes_call_text
from .tool_calls import ToolCall, ToolChoice, ToolDefinition, tool_call_reader, tool_constraint

MAX_N = 128  # OpenAI's bound on samples per prompt
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
# JSON's exactly representable integers: many clients and schema validators read numbers as doubles,
# so a seed past 2**53 would not be the seed they meant (the engine takes any 64-bit seed).
SEED_BOUND = 2**53


def _integral_float(value):
    """JSON Schema's integer includes 1.0; strict pydantic alone would refuse it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """An integer field as JSON Schema has it: 1.0 is one, true and "1" are not.
    The bounds come before the validator, or pydantic leaves them out of the schema."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral_float)]


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = integer(ge=0)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
TOKEN_ID_TEXT = "^(0|[1-9][0-9]*)$"
"""A token id as a JSON object key: its decimal digits, no leading zero."""
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_ID_TEXT)],
         Annotated[float, Field(ge=-LOGIT_BIAS_BOUND, le=LOGIT_BIAS_BOUND)]],
    # pydantic would write `patternProperties`, which lets any other key through; state the rule itself
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": TOKEN_ID_TEXT},
                    "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_BOUND,
                                             "maximum": LOGIT_BIAS_BOUND},
                    "description": "OpenAI's logit_bias: token id (as a string key) -> a bias in [-100, 100] added "
                                   "to that token's logit before temperature, penalties and structured masks"}),
]


def token_id_pattern(vocab_size: int) -> str:
    """A regex that fully matches the decimal text of exactly the ids in [0, vocab_size)
    (what the schema at /openapi.json states for logit_bias keys of the served model)."""
    top = str(vocab_size - 1)

    def digits(low: int, high: int, then: int) -> str:  # one digit in [low, high], then any `then` digits
        return (str(low) if low == high else f"[{low}-{high}]") + (f"[0-9]{{{then}}}" if then else "")

    forms = ["0"] + [digits(1, 9, k) for k in range(len(top) - 1)]  # fewer digits than the top id: any
    for i, digit in enumerate(top):  # as many: below the top id at the first digit where they differ
        low = 1 if i == 0 else 0
        if int(digit) > low:
            forms.append(top[:i] + digits(low, int(digit) - 1, len(top) - i - 1))
    return "^(" + "|".join(forms + [top]) + ")$"


def needs(field: str, flag: str) -> dict:
    """JSON Schema's `dependentSchemas` entry for "a non-null `field` needs
    `flag: true`": a model validator's rule, stated where clients read the schema."""
    return {field: {"anyOf": [{"properties": {field: {"type": "null"}}},
                              {"properties": {flag: {"const": True}}, "required": [flag]}]}}


STREAM_OPTIONS_NEED_STREAM = needs("stream_options", "stream")
TOP_LOGPROBS_NEED_LOGPROBS = needs("top_logprobs", "logprobs")
# max_tokens 0 generates nothing, which only echo makes useful: it scores the prompt
MAX_TOKENS_ZERO_NEEDS_ECHO = {"max_tokens": {"anyOf": [{"properties": {"max_tokens": {"not": {"const": 0}}}},
                                                       {"properties": {"echo": {"const": True}}, "required": ["echo"]}]}}


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(**REQUEST_CONFIG, json_schema_extra={"dependentSchemas": STREAM_OPTIONS_NEED_STREAM})

    model: str | None = None
    n: integer(ge=1, le=MAX_N) = 1
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: integer(ge=-SEED_BOUND, le=SEED_BOUND) | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: integer(ge=0) = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: integer() = 0
    cache_salt: str | None = Field(None, min_length=1)
    user: str | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None  # OpenAI: json_schema or json_object
    structured_outputs: StructuredOutputsBody | None = None  # vLLM's extra_body: json, regex, choice, grammar

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Engine settings for this request; None fields take the engine's defaults."""
        given = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty") if getattr(self, name) is not None}
        return SamplingParams(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                              max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, logit_bias=self.engine_logit_bias(),
                              structured_outputs=structured_params(self.response_format, self.structured_outputs),
                              **given)

    def engine_logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with int keys, as the engine takes it (None when not given)."""
        return None if self.logit_bias is None else {int(key): bias for key, bias in self.logit_bias.items()}

    def logit_bias_outside(self, vocab_size: int) -> list[int]:
        """The token ids `logit_bias` names that the served model does not have."""
        return [key for key in self.engine_logit_bias() or {} if key >= vocab_size]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. `prompt` is a string, a list of strings, a list of
    token ids, or a list of token-id lists; each prompt gets `n` choices.

    `echo: true` puts the prompt before each choice's text and, with `logprobs`,
    the prompt tokens' logprobs before the generated ones' (the first token's is
    null); `max_tokens: 0` (with echo only) scores the prompt and generates nothing,
    as lm-evaluation-harness asks for loglikelihoods. Streamed, each choice's
    first chunk carries the prompt."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {**STREAM_OPTIONS_NEED_STREAM,
                                                                      **MAX_TOKENS_ZERO_NEEDS_ECHO}})

    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: integer(ge=0) | None = 16
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _max_tokens_zero_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(  # ctx param: the 400 names the field (serving/errors.py)
                "max_tokens_zero_needs_echo", "max_tokens 0 generates nothing, which only echo: true makes useful "
                "(to score the prompt); send max_tokens >= 1, or echo: true", {"param": "max_tokens"})
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """With echo and logprobs the prompt is scored too (its top `logprobs`
        alternatives each); max_tokens 0 still generates one token in the engine,
        which the answer leaves out (as vLLM does)."""
        params = super().sampling_params(max(max_tokens, 1), logprobs)
        if self.echo and logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        return params

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back with the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The message as the prompt shows it (an assistant's tool calls as `<tool_call>` blocks)."""
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text for part in self.content)
        return text + "".join(hermes_call_text(c.function.name, c.function.arguments) for c in self.tool_calls or [])


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`. `max_completion_tokens` is OpenAI's newer
    name for `max_tokens`; give one of them, or neither for all the room the
    context leaves."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {**STREAM_OPTIONS_NEED_STREAM,
                                                                      **TOP_LOGPROBS_NEED_LOGPROBS}})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without (OpenAI's defaults)
    parallel_tool_calls: bool = True

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """As for completions, with the output constrained to tool calls when
        `tool_choice` is "required" or names a function, and to free text or
        well-formed calls under "auto" unless response_format or
        structured_outputs constrains it already (see `tool_calls`)."""
        params = super().sampling_params(max_tokens, logprobs)
        calls = tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        if calls is None:
            return params
        if params.structured_outputs is not None:
            if not self.forces_tool_call:
                return params  # the caller's constraint; calls in its output are still read
            raise RequestError("tool_choice forces a tool call, which fixes the output's form; drop response_format "
                               "or structured_outputs (not both)")
        return dataclasses.replace(params, structured_outputs=calls)

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice not in (None, "none", "auto")

    def tool_call_reader(self, constrained: bool) -> ToolCallReader | None:
        """How this request's output carries calls; `constrained`: whether the tool
        constraint was applied to it."""
        return tool_call_reader(self.tools, self.tool_choice, self.parallel_tool_calls, constrained)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
