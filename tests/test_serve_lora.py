"""`kvforge serve --lora-modules ...` driven by the official `openai` client: a
request's `model` picks a LoRA adapter (or the base model), and concurrent
requests of two adapters and the base give the greedy texts of offline
`LLM.generate(..., lora_request=...)`; /v1/models lists the adapters under their
parent; unknown adapters are 404; adapters load and unload at run time only with
`--enable-lora-updates`; /metrics counts each adapter's tokens."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from lora_tiny_adapters import write_tiny_adapter  # noqa: E402
from serve_process import openai_client, running_server  # noqa: E402

from kvforge import LLM, LoRARequest, SamplingParams  # noqa: E402

MODEL = "kvforge-tiny"
# Shorter than a KV block each, and each different: no request reuses another's prefix-cache blocks,
# so every prompt token is computed (the per-adapter prompt-token counts are exact).
PROMPTS = ["def f(x):", "import os", "class A:", "x = [1, 2", "for i in"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_tiny_adapter(root / name, seed) for name, seed in (("sql", 1), ("poet", 2), ("extra", 3))}


@pytest.fixture(scope="module")
def server(adapters):
    with running_server("--lora-modules", f"sql={adapters['sql']}", f"poet={adapters['poet']}", "--max-loras", "2",
                        "--max-cpu-loras", "3", "--enable-lora-updates") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def offline():
    return LLM(model=MODEL, lora={"max_loras": 2, "max_cpu_loras": 3})


def offline_texts(offline, prompts, lora: LoRARequest | None) -> list[str]:
    return [o.text for o in offline.generate(prompts, GREEDY, lora_request=lora)]


def test_each_test_adapter_changes_the_greedy_output(offline, adapters):
    """Otherwise the tests below could not tell an adapter from the base model."""
    base = offline_texts(offline, PROMPTS, None)
    sql = offline_texts(offline, PROMPTS, LoRARequest("sql", 1, str(adapters["sql"])))
    poet = offline_texts(offline, PROMPTS, LoRARequest("poet", 2, str(adapters["poet"])))
    assert all(b != s and b != p and s != p for b, s, p in zip(base, sql, poet))


def test_concurrent_requests_of_two_adapters_and_the_base_give_the_offline_greedy_texts(server, offline, adapters):
    expected = {MODEL: offline_texts(offline, PROMPTS, None),
                "sql": offline_texts(offline, PROMPTS, LoRARequest("sql", 1, str(adapters["sql"]))),
                "poet": offline_texts(offline, PROMPTS, LoRARequest("poet", 2, str(adapters["poet"])))}

    async def one(aclient, model: str, prompt: str) -> tuple[str, str]:
        reply = await aclient.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        return reply.model, reply.choices[0].text

    async def main():
        aclient = openai_client(server, async_=True)
        try:  # interleaved, so the adapters and the base share batches
            return await asyncio.gather(*(one(aclient, model, p) for p in PROMPTS for model in expected))
        finally:
            await aclient.close()

    results = iter(asyncio.run(main()))
    for i in range(len(PROMPTS)):
        for model, texts in expected.items():
            named, text = next(results)
            assert named == model, "a response names the adapter that wrote it, as vLLM's do"
            assert text == texts[i], (model, PROMPTS[i])


def test_chat_picks_the_adapter_by_model(client, offline, adapters):
    from kvforge.serving.chat_template import default_chat_prompt

    messages = [{"role": "user", "content": "import os"}]
    lora = LoRARequest("poet", 2, str(adapters["poet"]))
    expected = offline.generate([default_chat_prompt(messages)], GREEDY, lora_request=lora)[0].text
    reply = client.chat.completions.create(model="poet", messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected and reply.model == "poet"
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert base.choices[0].message.content != expected


def test_models_lists_the_base_then_each_adapter_with_its_parent_and_directory(client, adapters):
    models = {m.id: m for m in client.models.list().data}
    assert list(models)[:3] == [MODEL, "sql", "poet"]
    assert models[MODEL].model_extra["parent"] is None and models[MODEL].model_extra["root"] == MODEL
    for name in ("sql", "poet"):
        assert models[name].model_extra["parent"] == MODEL
        assert models[name].model_extra["root"] == str(adapters[name])


def test_an_unknown_adapter_is_404_model_not_found_naming_the_served_ones(client):
    for create in (lambda: client.completions.create(model="nope", prompt="x", max_tokens=2),
                   lambda: client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as info:
            create()
        assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
        assert "'sql'" in info.value.body["message"] and "'poet'" in info.value.body["message"]


def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(server, client, offline, adapters):
    status, _, body = server.request("POST", "/v1/load_lora_adapter",
                                     json.dumps({"lora_name": "extra", "lora_path": str(adapters["extra"])}).encode())
    assert status == 200 and body.decode() == "Success: LoRA adapter 'extra' added successfully."
    listed = {m.id: m for m in client.models.list().data}
    assert listed["extra"].model_extra["parent"] == MODEL
    expected = offline_texts(offline, PROMPTS[:1], LoRARequest("extra", 3, str(adapters["extra"])))
    reply = client.completions.create(model="extra", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert reply.choices[0].text == expected[0]
    status, _, body = server.request("POST", "/v1/unload_lora_adapter", json.dumps({"lora_name": "extra"}).encode())
    assert status == 200 and body.decode() == "Success: LoRA adapter 'extra' removed successfully."
    assert "extra" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt=PROMPTS[0], max_tokens=2)
    status, _, error = server.post_json("/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert status == 404 and error["error"]["code"] == "lora_adapter_not_found"


def test_an_adapter_unloads_by_the_number_the_server_gave_it(server, client, adapters):
    def post(path: str, body: dict) -> tuple[int, bytes]:
        status, _, raw = server.request("POST", path, json.dumps(body).encode())
        return status, raw

    assert post("/v1/load_lora_adapter", {"lora_name": "numbered", "lora_path": str(adapters["sql"])})[0] == 200
    for number in range(3, 20):  # --lora-modules took 1 and 2; run-time loads count on from 3, never reusing one
        status, raw = post("/v1/unload_lora_adapter", {"lora_int_id": number})
        if status == 200:
            break
        assert status == 404 and json.loads(raw)["error"]["param"] == "lora_int_id"
    assert status == 200
    served = [m.id for m in client.models.list().data]
    assert "numbered" not in served and {"sql", "poet"} <= set(served), "the one numbered so went, no other"


def test_loading_a_served_name_again_is_400_and_keeps_the_first(server, client, adapters):
    for name in ("sql", MODEL):
        status, _, error = server.post_json("/v1/load_lora_adapter",
                                            {"lora_name": name, "lora_path": str(adapters["poet"])})
        assert status == 400 and error["error"]["code"] == "lora_adapter_exists", error
    assert {m.id: m for m in client.models.list().data}["sql"].model_extra["root"] == str(adapters["sql"])


def test_a_directory_that_is_no_adapter_is_400_naming_the_missing_file(server, tmp_path, adapters):
    status, _, error = server.post_json("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert status == 400 and error["error"]["code"] == "invalid_lora_adapter"
    assert "adapter_config.json" in error["error"]["message"] and str(tmp_path) in error["error"]["message"]
    (tmp_path / "adapter_config.json").write_text((adapters["sql"] / "adapter_config.json").read_text())
    status, _, error = server.post_json("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert status == 400 and "adapter_model.safetensors" in error["error"]["message"]
    status, _, error = server.post_json("/v1/completions", {"model": "x", "prompt": "y"})
    assert status == 404, "a refused adapter is not served"


def test_metrics_count_each_adapters_tokens(server, client):
    def count(name: str, lora: str) -> float:
        return server.metric(name, lora_name=lora)

    before = {lora: (count("kvforge:lora_prompt_tokens_total", lora),
                     count("kvforge:lora_generation_tokens_total", lora)) for lora in ("sql", "poet")}
    prompt_tokens = {"sql": 0, "poet": 0}
    for lora, max_tokens, prompt in (("sql", 3, "a = 1;"), ("sql", 5, "b = 22;"), ("poet", 4, "c = 333;")):
        reply = client.completions.create(model=lora, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
        prompt_tokens[lora] += reply.usage.prompt_tokens
    assert count("kvforge:lora_prompt_tokens_total", "sql") == before["sql"][0] + prompt_tokens["sql"]
    assert count("kvforge:lora_generation_tokens_total", "sql") == before["sql"][1] + 8
    assert count("kvforge:lora_prompt_tokens_total", "poet") == before["poet"][0] + prompt_tokens["poet"]
    assert count("kvforge:lora_generation_tokens_total", "poet") == before["poet"][1] + 4


def test_lora_requests_info_names_the_adapter_while_its_request_runs(server, client):
    stream = client.completions.create(model="sql", prompt="while True:", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # one step has run with the request in it
        running = server.metric("vllm:lora_requests_info", running_lora_adapters="sql", max_lora="2")
        assert running > 0, "the series' value is the time of its update"
    finally:
        stream.close()
    server.wait_for(lambda: server.metric("vllm:lora_requests_info", running_lora_adapters="") > 0,
                    "the series to show no adapter running once the request ended")
    _, text = server.get("/metrics")
    assert text.decode().count("vllm:lora_requests_info{") == 1, "one series: the current adapters"


def test_without_updates_enabled_the_routes_answer_404_naming_the_flag_and_with_a_key_401():
    from fastapi.testclient import TestClient

    from kvforge.serving import ServeSettings, build_app

    engine = LLM(model=MODEL, lora={"max_loras": 1}).engine
    with TestClient(build_app(engine, ServeSettings(model_name=MODEL))) as http:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"}), ("/v1/unload_lora_adapter", {})):
            response = http.post(path, json=body)
            assert response.status_code == 404 and "--enable-lora-updates" in response.json()["error"]["message"]
        assert not any("lora" in path for path in http.get("/openapi.json").json()["paths"])
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    keyed = ServeSettings(model_name=MODEL, api_key="k", enable_lora_updates=True)
    with TestClient(build_app(engine, keyed)) as http:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert response.status_code == 401, "with --api-key, loading needs the key as every /v1 route does"


def serve_exit(capsys, *args: str) -> tuple[int, str]:
    """`kvforge serve` in this process, for starts refused before it serves."""
    from kvforge.cli import main

    code = main(["serve", MODEL, "--port", "0", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--lora-modules", "no-equals-sign"], "is not NAME=PATH"),
    (["--lora-modules", '{"name": "a"}'], "needs the strings name and path"),
    (["--lora-modules", "a=/x", "a=/y"], "more than once"),
    (["--lora-modules", "a=/x", "--data-parallel-size", "2"], "with LoRA adapters is not supported"),
])
def test_bad_lora_flags_stop_the_start_with_a_reason(capsys, args, says):
    code, err = serve_exit(capsys, *args)
    assert code == 2 and says in err, err[-2000:]


def test_an_adapter_that_cannot_load_stops_the_start_naming_its_file(capsys, tmp_path):
    code, err = serve_exit(capsys, "--lora-modules",
                           f'{{"name": "a", "path": "{tmp_path}", "base_model_name": "{MODEL}"}}')
    assert code == 2 and "--lora-modules 'a'" in err, err[-2000:]
    assert f"{tmp_path}" in err and "adapter_config.json" in err


def test_a_base_model_name_other_than_the_served_one_is_refused():
    from kvforge.cli_options import LoRAModule
    from kvforge.cli_serve import _load_adapters

    class Engine:  # nothing may be loaded: the entry is refused first
        def add_lora(self, request):
            raise AssertionError("loaded an adapter meant for another base model")

    with pytest.raises(ValueError, match="base_model_name 'other' is not the served model 'kvforge-tiny'"):
        _load_adapters(Engine(), [LoRAModule("a", "/p", "other")], MODEL)
