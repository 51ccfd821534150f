"""`kvforge serve`'s /openapi.json holds: schemathesis, with every check, finds no
request the server answers differently from what the schema says (and no 5xx),
and each mismatch it once found stays fixed: a missing body is a documented 400,
/health is JSON, /metrics is documented as Prometheus text, every error status
is documented with OpenAI's error body, an empty prompt is outside the schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import running_server  # noqa: E402

from kvforge.serving.openapi_schema import CODES_BEYOND_THE_SCHEMA  # noqa: E402

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
ERROR_BODY = {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def schema(server) -> dict:
    status, body = server.get("/openapi.json")
    assert status == 200
    return json.loads(body)


def responses(schema: dict, path: str, method: str = "post") -> dict:
    return schema["paths"][path][method]["responses"]


def test_schemathesis_finds_no_failure_with_every_check(server, tmp_path):
    """Coverage (each field's boundaries and wrong types) and a bounded fuzzing run, fixed seed.
    `positive_data_acceptance` runs as `schema_valid_request_accepted` (tests/openapi_hooks.py),
    which allows only the refusals /openapi.json documents as beyond the schema. The response-time
    limit is above the request timeout: a busy machine is not a failure."""
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "openapi_hooks", "PYTHONPATH": str(Path(__file__).parent),
           "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    command = [str(SCHEMATHESIS), "run", f"{server.base}/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance",
               "--max-response-time", "600",
               "--phases", "coverage,fuzzing", "--max-examples", "10", "--max-time", "30", "--seed", "1",
               "--workers", "1", "--request-timeout", "120", "--continue-on-failure", "--no-color",
               "--output-truncate", "true", "--output-sanitize", "false"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert "Coverage" in result.stdout and "Fuzzing" in result.stdout


def test_no_status_is_documented_as_422_and_a_missing_body_is_a_documented_400(server, schema):
    for path in GENERATION_ROUTES:
        documented = responses(schema, path)
        assert "422" not in documented and documented["400"]["content"]["application/json"]["schema"] == ERROR_BODY
        status, headers, body = server.post_json(path, b"")
        assert status == 400 and headers["content-type"] == "application/json", body
        assert body["error"]["code"] == "missing_body" and "JSON object" in body["error"]["message"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_every_bound_of_the_request_models_is_in_the_schema(schema):
    """pydantic writes a bound it cannot translate as its own keyword (`ge`), which JSON Schema ignores."""
    text = json.dumps(schema["components"]["schemas"])
    assert '"ge"' not in text and '"le"' not in text and '"gt"' not in text
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["n"]["minimum"] == 1


def test_every_error_status_of_the_generation_routes_is_documented_with_the_error_body(server, schema):
    for path in GENERATION_ROUTES:
        documented = responses(schema, path)
        for status in ("400", "404", "500", "503"):
            assert documented[status]["content"]["application/json"]["schema"] == ERROR_BODY, (path, status)
        assert "401" not in documented  # no API key: nothing answers 401
        assert "text/event-stream" in documented["200"]["content"]
    for code in CODES_BEYOND_THE_SCHEMA:
        assert code in responses(schema, "/v1/completions")["400"]["description"]
    status, _, body = server.post_json("/v1/completions", {"prompt": "x", "model": "not-this-one"})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


def test_health_answers_json_as_documented(server, schema):
    status, headers, body = server.request("GET", "/health")
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body) == {"status": "ok"}
    documented = responses(schema, "/health", "get")
    assert set(documented) == {"200", "503"}
    assert documented["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Health"}


def test_metrics_are_documented_as_prometheus_text(server, schema):
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"vllm:num_requests_running" in body
    assert list(responses(schema, "/metrics", "get")["200"]["content"]) == ["text/plain"]


def test_an_empty_prompt_is_outside_the_schema_and_refused(server, schema):
    forms = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert all(form.get("minLength") == 1 or form.get("minItems") == 1 for form in forms)
    for prompt in ("", [], [""], [[]]):
        status, _, body = server.post_json("/v1/completions", {"prompt": prompt})
        assert status == 400 and body["error"]["param"] == "prompt", (prompt, body)


def test_the_schema_states_the_served_models_token_ids_and_the_server_holds_to_them(server, schema):
    forms = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    largest = next(form["items"]["maximum"] for form in forms if form.get("items", {}).get("type") == "integer")
    status, _, body = server.post_json("/v1/completions", {"prompt": [largest], "max_tokens": 1})
    assert status == 200, body
    status, _, body = server.post_json("/v1/completions", {"prompt": [largest + 1], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, _, body = server.post_json("/v1/completions", {"prompt": [[1, True]], "max_tokens": 1})
    assert status == 400, "true is not a token id (JSON Schema's integer), though Python counts it as 1"
    status, _, body = server.post_json("/v1/completions", {"prompt": [1.0], "max_tokens": 2.0})
    assert status == 200, "JSON Schema's integer includes 1.0"


def test_a_seed_past_64_bits_is_refused_and_the_server_goes_on(server):
    status, _, body = server.post_json("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": 2**64})
    assert status == 400 and body["error"]["param"] == "seed", body
    status, _, body = server.post_json("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": 2**53, "n": 3})
    assert status == 200 and len(body["choices"]) == 3
    assert server.get("/health")[0] == 200


def test_with_an_api_key_the_schema_declares_the_bearer_key_and_its_401():
    with running_server("--api-key", "s3cret") as server:
        schema = json.loads(server.get("/openapi.json")[1])
        assert schema["components"]["securitySchemes"] == {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path in (*GENERATION_ROUTES, "/v1/models"):
            operation = next(iter(schema["paths"][path].values()))
            assert operation["security"] == [{"apiKey": []}] and "401" in operation["responses"]
        assert "security" not in schema["paths"]["/health"]["get"]
        status, _, body = server.post_json("/v1/completions", {"prompt": "x"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
