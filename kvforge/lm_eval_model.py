"""kvforge's offline engine as an lm-evaluation-harness model, registered as `kvforge`.

    import kvforge.lm_eval_model  # registers "kvforge" with lm_eval
    lm_eval.simple_evaluate(model="kvforge", model_args="pretrained=kvforge-tiny", tasks=[...])

Loglikelihoods come from prompt logprobs (`SamplingParams(prompt_logprobs=1)`):
context and continuation run as one prompt, and the continuation's tokens' logprobs
are summed; a continuation is greedy when each of its tokens is as likely as the
most likely token at its position, the rule lm_eval's `local-completions` applies
to a server's echoed logprobs, so both paths give the same answers. Rolling
loglikelihoods (perplexity tasks) are strided windows (`kvforge.perplexity`);
generation is greedy unless the task asks otherwise. Needs `pip install lm-eval`.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (lm_eval fills its registry lazily, only while it is empty: fill it first)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from kvforge.engine.llm import LLM
from kvforge.engine.sampling_params import SamplingParams

from .perplexity import score_tokens


@register_model("kvforge")
class KVForgeLM(TemplateLM):
    """`pretrained`: a model name or directory; other keyword arguments (from
    `model_args`, e.g. `dtype=float32`) are `LLM` settings. `llm` takes a ready `LLM`."""

    def __init__(self, pretrained: str = "kvforge-tiny", max_gen_toks: int = 256, llm: LLM | None = None,
                 **settings):
        super().__init__()
        for name in ("batch_size", "max_batch_size"):  # the engine batches every request of a call itself
            settings.pop(name, None)
        self.llm = llm if llm is not None else LLM(pretrained, **settings)
        self.tokenizer = self.llm.tokenizer
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.llm.engine.eos_token_id

    @property
    def max_length(self) -> int:
        return self.llm.engine.max_model_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        try:  # transformers' tokenizers: special tokens only when asked, as lm_eval's API models encode
            return list(self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)))
        except TypeError:  # kvforge's byte tokenizer adds none
            return list(self.tokenizer.encode(string))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        prompts = [(context + continuation)[-self.max_length:] for _, context, continuation in requests]
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, detokenize=False)
        outputs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=not disable_tqdm)
        results = []
        for (_, _, continuation), prompt, output in zip(requests, prompts, outputs):
            if output.error:
                raise RuntimeError(f"kvforge could not score a request: {output.error}")
            records = output.prompt_logprobs[len(prompt) - len(continuation):]
            logprob, greedy = 0.0, True
            for token, record in zip(continuation, records):
                logprob += record[token].logprob
                greedy = greedy and record[token].logprob >= max(v.logprob for v in record.values())
            results.append((logprob, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole loglikelihood, its first token conditioned on the EOS
        token as lm_eval's other models do, in windows of the model's context."""
        return [score_tokens(self.llm, [self.prefix_token_id, *self.tok_encode(text)])[0]
                for (text,) in (request.args for request in requests)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for context, gen_kwargs in (request.args for request in requests):
            gen_kwargs = dict(gen_kwargs)
            until = gen_kwargs.get("until") or []
            prompts.append(self.tok_encode(context))
            params.append(SamplingParams(max_tokens=int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)),
                                         temperature=float(gen_kwargs.get("temperature", 0) or 0)
                                         if gen_kwargs.get("do_sample", False) else 0.0,
                                         stop=[until] if isinstance(until, str) else list(until)))
        outputs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=not disable_tqdm)
        return [output.text for output in outputs]
