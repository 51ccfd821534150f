"""The JSON-schema meta-schema check runs once per schema text (it costs
milliseconds per request otherwise), and a refused schema is refused every time."""

from __future__ import annotations

import pytest

from kvforge import StructuredOutputsParams
from kvforge.core import RequestError
from kvforge.engine import structured_outputs_params

pytest.importorskip("jsonschema")


def test_a_repeated_schema_is_checked_once_and_a_bad_one_every_time(monkeypatch):
    checked = []
    real = structured_outputs_params.check_schema
    monkeypatch.setattr(structured_outputs_params, "check_schema",
                        lambda schema: checked.append(schema) or real(schema))
    structured_outputs_params.check_schema_text.cache_clear()
    schema = {"type": "object", "properties": {"cache_probe": {"type": "integer"}}}
    first = StructuredOutputsParams(json=schema)
    again = StructuredOutputsParams(json=dict(schema))
    as_text = StructuredOutputsParams(json='{"type": "object", "properties": {"cache_probe": {"type": "integer"}}}')
    assert first.spec() == again.spec() == as_text.spec()
    assert checked == [schema]
    for _ in range(2):
        with pytest.raises(RequestError, match="not a valid JSON schema at type"):
            StructuredOutputsParams(json={"type": 12})
    assert len(checked) == 3
