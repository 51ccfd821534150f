"""`StructuredOutputsParams`: what a request's output must match, as vLLM's
`SamplingParams(structured_outputs=...)` takes it, turned into core's
`StructuredOutputSpec` (the form backends compile and the grammar cache keys on)."""

from __future__ import annotations

import functools
import json as json_module
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvforge.core import RequestError
from kvforge.core.structured_output import (
    CHOICE,
    GRAMMAR,
    JSON,
    JSON_OBJECT,
    REGEX,
    STRUCTURAL_TAG,
    StructuredOutputSpec,
)

FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
OPTIONS = ("grammar_syntax", "any_whitespace", "close_within_max_tokens")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    * `json`: a JSON schema, as a dict or as JSON text; the output is a JSON
      document the schema validates.
    * `regex`: the output fully matches this regular expression.
    * `choice`: the output is exactly one of these strings.
    * `grammar`: the output is a sentence of this grammar, written in
      `grammar_syntax` (default "ebnf", xgrammar's and vLLM's GBNF dialect;
      "lark" for llguidance).
    * `json_object=True`: the output is any JSON object.
    * `structural_tag`: xgrammar's structural tag (JSON text), e.g. free text
      in which tagged tool calls follow their arguments' schemas.

    `any_whitespace` (JSON only): False, the default, makes compact JSON with no
    whitespace outside strings; True allows whitespace between JSON tokens, as
    the backend's library does (vLLM's default; its `disable_any_whitespace`
    inverted, since a small model given free whitespace may write nothing else).

    `close_within_max_tokens`: False, the default, lets `max_tokens` cut an
    unfinished output (finish_reason "length", as vLLM does); True makes the
    engine close the output within `max_tokens` when the model does not: near the
    end of the budget it forces the tokens of a short way to finish the document
    (see `structured_closing`), and the output ends on EOS (finish_reason "stop").
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    grammar_syntax: str = "ebnf"
    any_whitespace: bool = False
    structural_tag: str | None = None
    close_within_max_tokens: bool = False

    def __post_init__(self) -> None:
        given = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"structured_outputs needs exactly one of {', '.join(FIELDS)}; got "
                               f"{', '.join(given) if given else 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise RequestError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        for name in ("json_object", "any_whitespace", "close_within_max_tokens"):
            if getattr(self, name) is not True and getattr(self, name) is not False:
                raise RequestError(f"structured_outputs.{name} must be True or False, got {getattr(self, name)!r}")
        if self.any_whitespace and self.json is None and not self.json_object:
            raise RequestError("structured_outputs.any_whitespace applies to json and json_object only; "
                               "remove it or give a json schema")
        if self.json is not None:
            object.__setattr__(self, "json", schema_text(self.json))
        if self.regex is not None:
            check_regex(self.regex)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "StructuredOutputsParams":
        """From the request body's `structured_outputs` object (vLLM's field names);
        unknown keys are refused with the valid ones."""
        unknown = sorted(set(values) - set(FIELDS) - set(OPTIONS))
        if unknown:
            raise RequestError(f"structured_outputs has unknown fields {unknown}; valid: "
                               f"{', '.join(FIELDS + OPTIONS)}")
        return cls(**values)

    def spec(self) -> StructuredOutputSpec:
        """Core's hashable spec: equal params give equal specs, so they share a compiled grammar."""
        if self.json is not None:
            return StructuredOutputSpec(JSON, self.json, any_whitespace=self.any_whitespace)
        if self.regex is not None:
            return StructuredOutputSpec(REGEX, self.regex)
        if self.choice is not None:
            return StructuredOutputSpec(CHOICE, tuple(self.choice))
        if self.grammar is not None:
            return StructuredOutputSpec(GRAMMAR, self.grammar, self.grammar_syntax)
        if self.structural_tag is not None:
            return StructuredOutputSpec(STRUCTURAL_TAG, self.structural_tag)
        return StructuredOutputSpec(JSON_OBJECT, any_whitespace=self.any_whitespace)


def schema_text(schema: dict | str) -> str:
    """A JSON schema as compact text, so a schema given as a dict or as text shares one
    cache entry; text that is not JSON is refused with the parser's reason. Keys keep
    their order: the backends write an object's properties in the order `properties`
    lists them."""
    if isinstance(schema, str):
        try:
            schema = json_module.loads(schema)
        except ValueError as exc:
            raise RequestError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
    text = json_module.dumps(schema, separators=(",", ":"))
    check_schema_text(text)
    return text


@functools.lru_cache(maxsize=256)
def check_schema_text(text: str) -> None:
    """`check_schema` once per schema text: the meta-schema check costs milliseconds,
    and requests repeat their schemas (a refused one raises, and is checked again)."""
    check_schema(json_module.loads(text))


def check_schema(schema: dict | bool) -> None:
    """Refuse a schema that breaks the JSON Schema meta-schema, naming the broken part
    (when the `jsonschema` package is installed; the backend judges it otherwise)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise RequestError(f"structured_outputs.json is not a valid JSON schema at {where}: {exc.message}") from exc


def check_regex(pattern: str) -> None:
    """Refuse a pattern that does not parse as a regular expression, with the parser's reason."""
    import re

    try:
        re.compile(pattern)
    except re.error as exc:
        raise RequestError(f"structured_outputs.regex {pattern!r} is not a valid regular expression: {exc}") from exc
