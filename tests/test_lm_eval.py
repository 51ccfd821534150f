"""lm-evaluation-harness end to end on a small local multiple-choice task
(tests/lm_eval_tasks/): through `kvforge serve kvforge-tiny` with lm_eval's own
`local-completions` model (echo, logprobs, token-id prompts), and through the
offline engine with `kvforge.lm_eval_model`; both give the same loglikelihoods,
the same greedy flags and the same accuracy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from byte_hf_tokenizer import save_byte_tokenizer  # noqa: E402
from serve_process import running_server  # noqa: E402

from kvforge import LLM  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "lm_eval_tasks"
TASK = "kvforge_tiny_choice"
TOLERANCE = 1e-4


def evaluate(model, model_args=None) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                   task_manager=TaskManager(include_path=str(TASKS)), verbosity="ERROR")


def answers(results: dict) -> dict[int, list[tuple[float, bool]]]:
    """Per document, each choice's (loglikelihood, greedy)."""
    return {s["doc_id"]: [tuple(r[0]) for r in s["resps"]] for s in results["samples"][TASK]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.chdir(REPO)  # the task's data path is relative to the repository root
    import kvforge.lm_eval_model as kvforge_lm

    offline = evaluate(kvforge_lm.KVForgeLM(llm=LLM("kvforge-tiny", dtype="float32")))
    tokenizer = save_byte_tokenizer(tmp_path_factory.mktemp("byte_tokenizer"))
    with running_server() as server:
        served = evaluate("local-completions", {
            "base_url": server.base + "/v1/completions", "model": "kvforge-tiny", "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer), "num_concurrent": 1, "max_retries": 1})
    return offline, served


def test_served_and_offline_give_the_same_loglikelihoods_and_greedy_flags(results):
    offline, served = map(answers, results)
    assert sorted(offline) == sorted(served) and len(offline) == 8
    for doc in offline:
        assert [g for _, g in offline[doc]] == [g for _, g in served[doc]]
        assert [ll for ll, _ in offline[doc]] == pytest.approx([ll for ll, _ in served[doc]], abs=TOLERANCE)
        assert all(ll < 0 for ll, _ in offline[doc])


def test_served_and_offline_give_the_same_accuracy(results):
    offline, served = (r["results"][TASK] for r in results)
    assert offline["acc,none"] == served["acc,none"] and offline["acc_norm,none"] == served["acc_norm,none"]
    assert 0 < offline["acc,none"]  # the tiny model prefers some of the sensible endings


def test_the_offline_loglikelihood_is_the_sum_of_the_continuations_prompt_logprobs():
    import kvforge.lm_eval_model as kvforge_lm
    from kvforge.engine.sampling_params import SamplingParams

    llm = LLM("kvforge-tiny", dtype="float32")
    model = kvforge_lm.KVForgeLM(llm=llm)
    context, continuation = list(b"The cat sat on the"), list(b" mat.")
    ((logprob, _),) = model._loglikelihood_tokens([(("", ""), context, continuation)], disable_tqdm=True)
    (output,) = llm.generate(prompt_token_ids=[context + continuation],
                             sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))
    records = output.prompt_logprobs[len(context):]
    assert logprob == pytest.approx(sum(r[t].logprob for t, r in zip(continuation, records)), abs=1e-6)
