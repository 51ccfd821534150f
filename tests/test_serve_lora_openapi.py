"""With `--enable-lora-updates`, /openapi.json documents /v1/load_lora_adapter and
/v1/unload_lora_adapter, and schemathesis finds no answer of theirs that differs
from it (statuses, error bodies, content types, no 5xx, invalid bodies refused).

Schemathesis's `positive_data_acceptance` is left out here: a schema-valid
`lora_path` it makes up names no adapter directory, so refusing it (400
`invalid_lora_adapter`, documented) is right."""

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
from lora_tiny_adapters import write_tiny_adapter  # noqa: E402
from serve_process import running_server  # noqa: E402

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
ERROR_BODY = {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    adapter = write_tiny_adapter(tmp_path_factory.mktemp("adapters") / "sql", seed=1)
    with running_server("--lora-modules", f"sql={adapter}", "--enable-lora-updates") as s:
        yield s


def test_the_lora_routes_document_their_answers(server):
    schema = json.loads(server.get("/openapi.json")[1])
    load = schema["paths"]["/v1/load_lora_adapter"]["post"]["responses"]
    unload = schema["paths"]["/v1/unload_lora_adapter"]["post"]["responses"]
    assert set(load) == {"200", "400", "503"} and set(unload) == {"200", "400", "404", "503"}
    for responses in (load, unload):
        assert list(responses["200"]["content"]) == ["text/plain"]
        assert all(responses[s]["content"]["application/json"]["schema"] == ERROR_BODY for s in responses if s != "200")
    assert "invalid_lora_adapter" in load["400"]["description"]


def test_schemathesis_finds_no_failure_on_the_lora_routes(server, tmp_path):
    env = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    command = [str(SCHEMATHESIS), "run", f"{server.base}/openapi.json", "--include-path-regex", "lora_adapter",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-response-time", "600",
               "--phases", "coverage,fuzzing", "--max-examples", "20", "--max-time", "20", "--seed", "1",
               "--workers", "1", "--request-timeout", "120", "--continue-on-failure", "--no-color",
               "--output-truncate", "true", "--output-sanitize", "false"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert "Coverage" in result.stdout and "Fuzzing" in result.stdout
