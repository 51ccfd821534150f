"""What the structured_output group walks: two vocabularies and a corpus of specs.

The vocabularies: kvforge-tiny's byte-level one (ids 0-255 are the bytes, then
bos, eos, pad), and `MERGED`, a byte-level BPE-like one with multi-byte tokens
(JSON punctuation runs, keywords, digit pairs, words, multi-byte UTF-8), its EOS
and a special token first, and logits wider than its tokens. The corpus: JSON
schemas (hand-written ones and generated families), regexes and choices, each
with the judge that says whether a finished output is right. Patterns write digits
as [0-9]: `\\d` is ASCII in JSON schema (ECMA-262) but Unicode in Python's and
Rust's regexes, so the judge and a library could disagree on what it allows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass

from kvforge.core import StructuredOutputSpec, Vocabulary
from kvforge.core.structured_output import CHOICE, GRAMMAR, JSON, JSON_OBJECT, REGEX

TINY = Vocabulary(token_bytes=tuple(bytes([i]) for i in range(256)) + (b"", b"", b""), eos_token_ids=(257,),
                  vocab_size=259, special_token_ids=frozenset({256, 257, 258}))
"""kvforge-tiny's tokenizer (models/builtin/kvforge-tiny: bos 256, eos 257, pad 258; a test keeps the two in step)."""

_MERGES = [
    '{"', '"}', '":', '",', '", "', '": "', '": ', '": [', '":[', '],', ']}', '}]', '},', '}, {', '[{', '[]', '{}',
    '""', ', ', ',"', '["', '"]', 'true', 'false', 'null', 'tr', 'ue', 'fa', 'lse', 'nu', 'll', 'name', 'id', 'age',
    'type', 'value', 'items', 'tags', 'email', 'the', 'and', 'ing', 'er', 'on', 'an', ' a', ' t', '  ', '\n  ',
    '\n', '-1', '0.', '.5', 'e+', 'E-', '10', '00', '12', '99', '1.0', 'abc', 'xyz', 'foo', 'bar', 'yes', 'no',
    'é', 'ü', '€', '日本', '😀', '\\"', '\\n', '\\u', '://', 'http', '@', '.com',
]
MERGED = Vocabulary(
    token_bytes=(b"", b"") + tuple(bytes([i]) for i in range(256)) + tuple(m.encode() for m in _MERGES),
    eos_token_ids=(0,), vocab_size=2 + 256 + len(_MERGES) + 37, special_token_ids=frozenset({0, 1}))
"""A multi-byte vocabulary: EOS 0, a special token 1, the bytes at 2-257, merges after, 37 padding ids."""

VOCABULARIES = {"kvforge-tiny": TINY, "merged": MERGED}


@dataclass(frozen=True)
class Case:
    """One spec of the corpus; `basic` ones use only the JSON-schema keywords every
    JSON backend must enforce (type, properties, required, items, enum, const)."""

    name: str
    spec: StructuredOutputSpec
    basic: bool = False
    judge: str | None = None  # a grammar's language as a Python regex

    def accepts(self, text: str) -> bool:
        """Whether `text` is a right output for the spec (jsonschema judges JSON)."""
        if self.spec.kind in (JSON, JSON_OBJECT):
            import jsonschema

            try:
                document = json.loads(text)
            except ValueError:
                return False
            schema = json.loads(self.spec.value) if self.spec.value else {"type": "object"}
            return jsonschema.Draft202012Validator(schema).is_valid(document)
        if self.spec.kind in (REGEX, GRAMMAR):
            return re.fullmatch(self.judge or self.spec.value, text) is not None
        return text in self.spec.value


def with_any_whitespace(case: Case) -> Case:
    """The same JSON case with whitespace allowed between JSON tokens (the corpus's are compact)."""
    return dataclasses.replace(case, name=f"{case.name} (any whitespace)",
                               spec=dataclasses.replace(case.spec, any_whitespace=True))


def _json(name: str, schema: dict, basic: bool = False) -> Case:
    return Case(name, StructuredOutputSpec(JSON, json.dumps(schema)), basic)


BASIC_KEYWORDS = {"type", "properties", "required", "items", "enum", "const"}

_PRIMITIVES = {
    "string": {"type": "string"}, "integer": {"type": "integer"}, "number": {"type": "number"},
    "boolean": {"type": "boolean"}, "null": {"type": "null"}, "enum": {"enum": ["red", "green", "blue"]},
    "const": {"const": "fixed"}, "int_enum": {"enum": [1, 2, 3]},
}


def _uses_only_basic(schema) -> bool:
    if isinstance(schema, list):
        return all(map(_uses_only_basic, schema))
    if not isinstance(schema, dict):
        return True
    if not set(schema) <= BASIC_KEYWORDS:
        return False
    children = list(schema.get("properties", {}).values()) + ([schema["items"]] if "items" in schema else [])
    return all(map(_uses_only_basic, children))


def _families() -> list[Case]:
    cases = []
    for (name, inner) in _PRIMITIVES.items():  # each primitive alone, in objects, arrays and wrappers
        wrappers = {
            "alone": inner,
            "required_field": {"type": "object", "properties": {"f": inner}, "required": ["f"]},
            "optional_field": {"type": "object", "properties": {"f": inner, "g": inner}},
            "closed_object": {"type": "object", "properties": {"f": inner, "g": {"type": "integer"}},
                              "required": ["f"], "additionalProperties": False},
            "array": {"type": "array", "items": inner},
            "bounded_array": {"type": "array", "items": inner, "minItems": 1, "maxItems": 3},
            "nullable": {"anyOf": [inner, {"type": "null"}]},
            "ref": {"$defs": {"thing": inner}, "type": "object", "properties": {"t": {"$ref": "#/$defs/thing"}},
                    "required": ["t"], "additionalProperties": False},
            "nested": {"type": "object", "properties": {"outer": {"type": "object", "properties": {"f": inner},
                                                                  "required": ["f"]}}, "required": ["outer"]},
            "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {"f": inner},
                                                            "required": ["f"]}, "maxItems": 2},
        }
        for wrapper, schema in wrappers.items():
            cases.append(_json(f"{name}/{wrapper}", schema, _uses_only_basic(schema)))
    for low, high in [(0, 10), (-5, 5), (100, 200), (-1000, -10), (0, 0), (7, 1000000)]:
        cases.append(_json(f"integer/range[{low},{high}]", {"type": "integer", "minimum": low, "maximum": high}))
        cases.append(_json(f"number/range[{low},{high}]", {"type": "number", "minimum": low, "maximum": high}))
    for low in (0, 3, 10):
        cases.append(_json(f"integer/exclusive>{low}", {"type": "integer", "exclusiveMinimum": low}))
    for low, high in [(0, 3), (1, 1), (2, 8), (5, 12), (0, 0)]:
        cases.append(_json(f"string/length[{low},{high}]", {"type": "string", "minLength": low, "maxLength": high}))
    for pattern in ["^[a-z]+$", "^[A-Z]{3}$", "^[0-9]{3}-[0-9]{4}$", "^(yes|no|maybe)$", "^[a-f0-9]{8}$",
                    "^x+y*$", "^[a-z]{2,5}@[a-z]{2,5}\\.com$"]:
        cases.append(_json(f"string/pattern {pattern}", {"type": "string", "pattern": pattern}))
    for types in (["string", "null"], ["integer", "null"], ["boolean", "null"], ["number", "string"]):
        cases.append(_json(f"types/{'+'.join(types)}", {"type": types}))
    for combinator in ("anyOf", "oneOf"):
        for left, right in itertools.combinations(["string", "integer", "boolean", "null"], 2):
            schema = {combinator: [{"type": left}, {"type": right}]}
            cases.append(_json(f"{combinator}/{left}|{right}", schema))
    for size in (1, 2, 3, 4, 6, 8):
        props = {f"p{i}": list(_PRIMITIVES.values())[i % len(_PRIMITIVES)] for i in range(size)}
        cases.append(_json(f"object/all_required[{size}]", {"type": "object", "properties": props,
                                                             "required": sorted(props)}, _uses_only_basic(props)))
        cases.append(_json(f"object/closed_optional[{size}]", {"type": "object", "properties": props,
                                                                "additionalProperties": False}))
    for depth in (1, 2, 3, 4):
        schema: dict = {"type": "integer"}
        for level in range(depth):
            schema = {"type": "array", "items": schema, "maxItems": 2} if level % 2 else \
                {"type": "object", "properties": {f"l{level}": schema}, "required": [f"l{level}"]}
        cases.append(_json(f"nested/depth{depth}", schema))
    return cases


_HAND_WRITTEN = [
    _json("person", {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 150},
        "email": {"type": ["string", "null"]}}, "required": ["name", "age"], "additionalProperties": False}),
    _json("tool_call", {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}, "required": ["name", "arguments"],
        "additionalProperties": False}),
    _json("order", {"type": "object", "properties": {"id": {"type": "integer"}, "items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}},
        "required": ["id", "items"], "additionalProperties": False}),
    _json("tree_defs", {"$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer"}},
                                           "required": ["v"], "additionalProperties": False},
                                  "pair": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "minItems": 2,
                                           "maxItems": 2}},
                        "type": "object", "properties": {"left": {"$ref": "#/$defs/pair"}, "right": {
                            "$ref": "#/$defs/leaf"}}, "required": ["left", "right"], "additionalProperties": False}),
    _json("event", {"type": "object", "properties": {"kind": {"enum": ["click", "view"]}, "x": {"type": "number"},
                                                     "tags": {"type": "array", "items": {"type": "string",
                                                                                        "maxLength": 5},
                                                              "maxItems": 4}},
                    "required": ["kind"], "additionalProperties": False}),
    _json("unicode_enum", {"enum": ["é", "日本", "😀", "plain"]}, basic=True),
    _json("escaped_strings", {"enum": ["a\"b", "back\\slash", "new\nline", "tab\t"]}, basic=True),
    _json("any_object_closed_empty", {"type": "object", "additionalProperties": False}),
    _json("shape_oneof", {"oneOf": [
        {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0}}, "required": ["circle"],
         "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 0}}, "required": ["square"],
         "additionalProperties": False}]}),
    _json("matrix", {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9},
                                                "minItems": 2, "maxItems": 2}, "minItems": 1, "maxItems": 2}),
    _json("bool_flags", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
                         "required": ["a", "b"]}, basic=True),
    _json("nullable_nested", {"type": "object", "properties": {"child": {"anyOf": [
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
         "additionalProperties": False}, {"type": "null"}]}}, "required": ["child"], "additionalProperties": False}),
    Case("json_object", StructuredOutputSpec(JSON_OBJECT), basic=True),
]

REGEXES = ["[a-z]+", "(ab|abc)d?", "[0-9]{1,4}", "-?[0-9]+(\\.[0-9]{1,2})?", "(red|green|blue)", "[A-Z][a-z]{2,6}",
           "x*y+z?", "[0-9]{3}-[0-9]{4}", "(foo|bar)(,(foo|bar)){0,3}", "[a-f0-9]{4}", "(true|false)",
           "[a-z]{1,3}@[a-z]{1,3}\\.(com|org)", "é+|ü", "[ab]{2}[cd]{0,2}"]
CHOICES = [("yes", "no"), ("positive", "negative", "neutral"), ("a", "ab", "abc"), ("1+1", "(x)", "a.b", "[?]"),
           ("é", "日本語", "😀"), ("the cat", "the dog", "a bird"), ("x",)]


GRAMMARS = [  # (syntax, grammar, the same language as a regex)
    ("ebnf", 'root ::= "(" [a-z]+ ")"', r"\([a-z]+\)"),
    ("ebnf", 'root ::= item ("," item)*\nitem ::= [0-9] | "x"', r"([0-9]|x)(,([0-9]|x))*"),
    ("ebnf", 'root ::= "yes" | "no" | "maybe"', r"yes|no|maybe"),
    ("ebnf", 'root ::= "[" (pair (", " pair)*)? "]"\npair ::= [a-c] "=" [0-9]', r"\[([a-c]=[0-9](, [a-c]=[0-9])*)?\]"),
    ("lark", 'start: "(" /[a-z]+/ ")"', r"\([a-z]+\)"),
    ("lark", 'start: item ("," item)*\nitem: /[0-9]/ | "x"', r"([0-9]|x)(,([0-9]|x))*"),
    ("lark", 'start: "yes" | "no" | "maybe"', r"yes|no|maybe"),
    ("lark", 'start: "[" (pair (", " pair)*)? "]"\npair: /[a-c]/ "=" /[0-9]/', r"\[([a-c]=[0-9](, [a-c]=[0-9])*)?\]"),
]


def corpus() -> list[Case]:
    """Every case, JSON schemas first."""
    return [*_HAND_WRITTEN, *_families(),
            *(Case(f"regex {r}", StructuredOutputSpec(REGEX, r)) for r in REGEXES),
            *(Case(f"choice {'|'.join(c)}", StructuredOutputSpec(CHOICE, c)) for c in CHOICES),
            *(Case(f"{syntax} {text.splitlines()[0]}", StructuredOutputSpec(GRAMMAR, text, syntax), judge=judge)
              for syntax, text, judge in GRAMMARS)]


INVALID_SPECS = [
    StructuredOutputSpec(JSON, "{not json"),
    StructuredOutputSpec(JSON, '{"type": "no-such-type"}'),
    StructuredOutputSpec(REGEX, "a(b"),
    StructuredOutputSpec(REGEX, "[z-a]"),
]
"""Specs every backend that compiles their kind must refuse with a StructuredOutputError."""
INVALID_GRAMMARS = {"ebnf": 'root ::= undefined_rule', "lark": "start: undefined_rule"}
