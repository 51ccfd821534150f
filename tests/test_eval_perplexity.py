"""`kvforge eval perplexity`: strided windows through the engine's paged path give
transformers' own perplexity (its loss over the labels each window scores, as in
its perplexity guide), whatever the window and stride."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvforge import LLM
from kvforge.cli import main
from kvforge.core import RequestError
from kvforge.engine import prompt_logprobs as scoring
from kvforge.models.loader import resolve_model_dir
from kvforge.perplexity import perplexity, strided_windows

transformers = pytest.importorskip("transformers")

TEXT_FILE = resolve_model_dir("kvforge-tiny") / "heldout_slice.txt"
NUM_BYTES = 300  # the slice's first bytes: enough for several windows, quick on 2 cores


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    return list(TEXT_FILE.read_bytes()[:NUM_BYTES])  # kvforge-tiny's tokens are the bytes


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("kvforge-tiny", dtype="float32")


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("kvforge-tiny")),
                                                             dtype=torch.float32).eval()


def transformers_perplexity(model, ids: list[int], max_length: int, stride: int) -> float:
    """transformers' guide: each window's labels are its tokens past the previous
    window's end (the rest -100); its loss is the mean over the shifted labels."""
    nll, count, previous_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        inputs = torch.tensor([ids[begin:end]])
        labels = inputs.clone()
        labels[:, :-(end - previous_end)] = -100
        with torch.no_grad():
            loss = model(inputs, labels=labels).loss.item()
        scored = int((labels[:, 1:] != -100).sum())
        nll, count, previous_end = nll + loss * scored, count + scored, end
        if end == len(ids):
            break
    return math.exp(nll / count)


@pytest.mark.parametrize("max_length, stride", [(64, 32), (100, 100), (128, 17), (NUM_BYTES, NUM_BYTES)])
def test_perplexity_is_transformers_strided_computation(llm, hf_model, token_ids, max_length, stride):
    ours = perplexity(llm, token_ids, max_length, stride)
    assert ours.perplexity == pytest.approx(transformers_perplexity(hf_model, token_ids, max_length, stride),
                                            rel=1e-5)


def test_a_scorer_one_position_off_changes_the_perplexity(llm, hf_model, token_ids, monkeypatch):
    """Planted: each prompt token scored with its own position's logits."""
    monkeypatch.setattr(scoring, "scored_tokens", lambda request, count: request.prompt_token_ids[
        len(request.prompt_logprobs) - 1:len(request.prompt_logprobs) - 1 + count])
    try:
        ours = perplexity(llm, token_ids, 64, 32).perplexity
    except KeyError:  # a record without the token asked for: caught as surely
        return
    assert ours != pytest.approx(transformers_perplexity(hf_model, token_ids, 64, 32), rel=1e-2)


@pytest.mark.parametrize("num_tokens, max_length, stride", [(300, 64, 32), (300, 64, 64), (65, 64, 1), (2, 2, 1)])
def test_windows_score_every_token_once_but_those_without_context(num_tokens, max_length, stride):
    windows = strided_windows(num_tokens, max_length, stride)
    scored = [t for w in windows for t in range(w.first_scored, w.end)]
    assert len(scored) == len(set(scored))  # at most once
    unscored = set(range(num_tokens)) - set(scored)
    begins = {w.begin for w in windows}
    assert unscored == ({0} if stride < max_length else begins)  # only tokens no window gives context to
    assert all(w.end - w.begin <= max_length and w.first_scored > w.begin for w in windows)
    assert windows[-1].end == num_tokens


@pytest.mark.parametrize("args, why", [((10, 0, 1), "max_length must be"), ((10, 4, 5), "stride must be"),
                                       ((1, 4, 2), "at least 2")])
def test_bad_windows_are_refused_naming_the_setting(args, why):
    with pytest.raises(RequestError, match=why):
        strided_windows(*args)


def test_the_command_prints_the_functions_figures(llm, token_ids, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(token_ids))
    assert main(["eval", "perplexity", "kvforge-tiny", str(text), "--max-length", "64", "--stride", "32", "--json",
                 "--no-progress", "--set", "dtype=\"float32\""]) == 0
    figures = json.loads(capsys.readouterr().out)
    expected = perplexity(llm, token_ids, 64, 32)
    assert figures["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert (figures["scored_tokens"], figures["windows"]) == (expected.num_scored_tokens, expected.num_windows)


def test_a_quantized_kv_cache_is_scored_through_its_quantizer(token_ids, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(token_ids))
    args = ["eval", "perplexity", "kvforge-tiny", str(text), "--max-length", "64", "--stride", "32", "--json",
            "--no-progress"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--kv-cache-dtype", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["kv_cache_dtype"] == "int8" and int8["perplexity"] != plain["perplexity"]
    assert int8["perplexity"] == pytest.approx(plain["perplexity"], rel=0.05)


def test_a_missing_file_is_refused_naming_it(tmp_path, capsys):
    assert main(["eval", "perplexity", "kvforge-tiny", str(tmp_path / "none.txt")]) == 2
    assert "none.txt: no such file" in capsys.readouterr().err
