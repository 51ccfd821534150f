"""`StructuredOutputsParams`: exactly one constraint, checked when built, turned into
core's hashable spec (the key compiled grammars are cached by)."""

from __future__ import annotations

import pytest

from kvforge import SamplingParams, StructuredOutputsParams
from kvforge.core import RequestError
from kvforge.core.structured_output import StructuredOutputSpec


def test_each_field_becomes_its_spec_kind():
    assert StructuredOutputsParams(regex="[0-9]+").spec() == StructuredOutputSpec("regex", "[0-9]+")
    assert StructuredOutputsParams(choice=["a", "b"]).spec() == StructuredOutputSpec("choice", ("a", "b"))
    assert StructuredOutputsParams(grammar='root ::= "x"').spec() == StructuredOutputSpec("grammar", 'root ::= "x"', "ebnf")
    assert StructuredOutputsParams(json_object=True).spec() == StructuredOutputSpec("json_object")


def test_a_schema_as_a_dict_or_as_text_gives_one_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = '{"type": "object",\n "properties": {"a": {"type": "integer"}}}'
    assert StructuredOutputsParams(json=schema).spec() == StructuredOutputsParams(json=text).spec()
    assert hash(StructuredOutputsParams(json=schema).spec()) == hash(StructuredOutputsParams(json=text).spec())


def test_a_schema_keeps_the_order_of_its_properties():
    """The backends write properties in the order the schema lists them: sorting the keys would reorder the output."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    text = StructuredOutputsParams(json=schema).spec().value
    assert text.index('"name"') < text.index('"age"')


@pytest.mark.parametrize("fields, named", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": {"type": "objekt"}}, "not a valid JSON schema at type"),
    ({"json": {"properties": {"a": {"minLength": -1}}}}, "properties/a/minLength"),
    ({"regex": "a("}, "not a valid regular expression"),
    ({"choice": []}, "non-empty list of strings"),
    ({"choice": "ab"}, "non-empty list of strings"),
])
def test_an_invalid_constraint_is_refused_naming_the_problem(fields, named):
    with pytest.raises(RequestError, match=named):
        StructuredOutputsParams(**fields)


def test_the_request_body_form_refuses_unknown_fields_listing_the_valid_ones():
    assert StructuredOutputsParams.from_dict({"choice": ["x"]}).choice == ("x",)
    with pytest.raises(RequestError, match="unknown fields \\['json_schema'\\]; valid: json, regex"):
        StructuredOutputsParams.from_dict({"json_schema": {}})


def test_sampling_params_take_it_as_an_object_or_a_dict_and_refuse_what_fights_the_grammar():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(RequestError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})
    with pytest.raises(RequestError, match="min_tokens \\(2\\) cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    with pytest.raises(RequestError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="a+")


def test_json_is_compact_unless_any_whitespace_is_asked_for():
    schema = {"type": "object"}
    assert StructuredOutputsParams(json=schema).spec().any_whitespace is False
    flexible = StructuredOutputsParams.from_dict({"json": schema, "any_whitespace": True}).spec()
    assert flexible.any_whitespace is True and flexible != StructuredOutputsParams(json=schema).spec()
    assert StructuredOutputsParams(json_object=True, any_whitespace=True).spec().any_whitespace is True
    with pytest.raises(RequestError, match="any_whitespace applies to json and json_object only"):
        StructuredOutputsParams(regex="a+", any_whitespace=True)
    with pytest.raises(RequestError, match="any_whitespace must be True or False, got 'yes'"):
        StructuredOutputsParams(json=schema, any_whitespace="yes")
