"""`/v1/completions` and `/v1/chat/completions`: check the request, hand its
prompts to the engine loop, and answer with one JSON body or a stream of
server-sent events, in OpenAI's shapes.

Everything that can be refused is refused before the engine sees the request
(400 naming the field, 404 for a model not served here, 503 when the queue is
full), so a bad request never disturbs the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvforge.core import RequestError
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.lora_request import LoRARequest
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.structured_outputs import is_spec_error

from .chat_template import chat_prompt_token_ids
from .data_parallel_loop import DataParallelLoop
from .engine_loop import EngineDeadError, EngineLoop
from .errors import APIError, bad_request, error_body
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .replica_pool import ReplicaPool
from .responses import (SSE_DONE, TokenText, chat_logprobs, choice_index, completion_logprobs, echo_logprobs, failed,
                        prompt_text_length, sse, usage)
from .router import Router
from .served_adapters import ServedAdapters
from .served_model import ServedModel
from .structured_protocol import INVALID_STRUCTURED_OUTPUT, STRUCTURED_OUTPUTS
from .tool_call_format import ToolCallReader
from .tool_call_stream import ToolCallDeltas
from .tool_calls import INVALID_TOOL_CHOICE, chat_answer

log = logging.getLogger(__name__)


@dataclass
class ServeSettings:
    """How the server answers. `model_name` is the id clients send as `model`;
    `max_waiting_requests` bounds requests accepted but not yet scheduled (None:
    unbounded), beyond which a request gets 503 with `Retry-After`. `lora_modules`
    are the LoRA adapters served from the start (loaded by the engine already);
    `enable_lora_updates` opens /v1/load_lora_adapter and /v1/unload_lora_adapter."""

    model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = None
    retry_after_s: int = 1
    data_parallel_routing: str = "least_tokens"  # with replicas: see router.py
    lora_modules: list[LoRARequest] = dataclasses.field(default_factory=list)
    enable_lora_updates: bool = False


@dataclass
class _Prepared:
    """One HTTP request, checked and split into engine requests (one per prompt)."""

    response_id: str
    created: int
    requests: list[tuple[str, list[int], SamplingParams]]
    n: int
    logprobs: int | None
    model: str = ""  # the `model` the response names: the served model's, or the LoRA adapter's
    lora_request: LoRARequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids, _ in self.requests)


class OpenAIServer:
    """The engine loop, the metrics, and the two generation endpoints: over one
    in-process `engine`, or over the data-parallel `replicas` (processes of their own)."""

    def __init__(self, engine: LLMEngine | None, settings: ServeSettings, *, replicas: ReplicaPool | None = None):
        self.settings = settings
        if replicas is None:
            self.model = ServedModel.of(engine)
            self.metrics = ServerMetrics(settings.model_name, self.model.max_model_len, self.model.block_size)
            self.loop = EngineLoop(engine, on_step=self.metrics.on_step)
        else:
            self.model = replicas.model
            self.metrics = ServerMetrics(settings.model_name, self.model.max_model_len, self.model.block_size,
                                         num_engines=len(replicas.replicas))
            router = Router(len(replicas.replicas), settings.data_parallel_routing,
                            prefix_tokens=self.model.block_size, imbalance_slack_tokens=self.model.max_model_len)
            self.loop = DataParallelLoop(replicas, router, self.metrics)
        self.token_text = TokenText(self.model.tokenizer)
        self.adapters = ServedAdapters(settings.model_name, self.loop, settings.lora_modules)

    # Endpoints

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        lora = self.adapters.resolve(body.model)
        given = body.prompts()
        prompts = [self._tokenize(p, f"prompt[{i}]" if len(given) > 1 else "prompt") for i, p in enumerate(given)]
        if not prompts:
            raise bad_request("prompt is empty; give a string, a list of strings or token ids", param="prompt")
        prepared = self._prepare("cmpl", body, prompts, body.max_tokens, body.logprobs, "prompt")
        prepared.model, prepared.lora_request = body.model or self.settings.model_name, lora
        queue = await self._submit(prepared, body)
        outputs = self.loop.outputs(queue, [rid for rid, _, _ in prepared.requests])
        if body.stream:
            return _event_stream(self._completion_events(prepared, body, outputs), self._aborter(prepared))
        finals = await _until_disconnected(request, _finals(outputs))
        if finals is None:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for p, (rid, _, _) in enumerate(prepared.requests):
            output = finals[rid]
            _raise_if_failed(output)
            for c in output.outputs:
                choice = self._echoed(body, given[p], output, c) if body.echo else {
                    "text": c.text, "logprobs": completion_logprobs(c, prepared.logprobs or 0, self.token_text, False),
                    "finish_reason": c.finish_reason}
                completion_tokens += len(c.token_ids) if body.max_tokens != 0 else 0
                choices.append({"index": choice_index(p, prepared.n, c), **choice, "stop_reason": c.stop_reason})
        choices.sort(key=lambda choice: choice["index"])
        return JSONResponse({"id": prepared.response_id, "object": "text_completion", "created": prepared.created,
                             "model": prepared.model, "choices": choices,
                             "usage": usage(prepared.num_prompt_tokens, completion_tokens)})

    def _echoed(self, body: CompletionRequest, prompt: str | list[int], output: RequestOutput, c) -> dict:
        """A choice's text and logprobs with the prompt before them; with max_tokens 0
        the one token the engine generated is left out."""
        text = prompt if isinstance(prompt, str) else self.token_text.text_of(prompt)
        generate = body.max_tokens != 0
        logprobs = None
        if body.logprobs is not None:
            generated = completion_logprobs(c, body.logprobs, self.token_text, False,
                                            prompt_text_length(output.prompt_token_ids, self.token_text))
            logprobs = echo_logprobs(output.prompt_token_ids, output.prompt_logprobs, self.token_text,
                                     generated if generate else None)
        return {"text": text + c.text if generate else text, "logprobs": logprobs,
                "finish_reason": c.finish_reason if generate else "length"}

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        lora = self.adapters.resolve(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        prompt = chat_prompt_token_ids(self.model.tokenizer, messages, tools)
        prepared = self._prepare("chatcmpl", body, [prompt], body.requested_max_tokens, body.num_logprobs, "messages",
                                 max_tokens_param="max_completion_tokens" if body.max_completion_tokens is not None
                                 else "max_tokens")
        prepared.model, prepared.lora_request = body.model or self.settings.model_name, lora
        prepared, queue = await self._submit_chat(prepared, body)
        reader = body.tool_call_reader(constrained=prepared.requests[0][2].structured_outputs is not None)
        outputs = self.loop.outputs(queue, [prepared.requests[0][0]])
        if body.stream:
            return _event_stream(self._chat_events(prepared, body, reader, outputs), self._aborter(prepared))
        finals = await _until_disconnected(request, _finals(outputs))
        if finals is None:
            return Response(status_code=499)
        output = finals[prepared.requests[0][0]]
        _raise_if_failed(output)
        choices = []
        for c in sorted(output.outputs, key=lambda c: c.index):
            message, finish_reason = chat_answer(c.text, c.finish_reason, reader)
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(c, prepared.logprobs or 0, self.token_text, False),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({"id": prepared.response_id, "object": "chat.completion", "created": prepared.created,
                             "model": prepared.model, "choices": choices,
                             "usage": usage(prepared.num_prompt_tokens, sum(len(c.token_ids) for c in output.outputs))})

    # Checks

    def _tokenize(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
            if bad:
                raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {self.model.vocab_size})",
                                  param=param)
            return list(prompt)
        if self.model.tokenizer is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", param=param)
        return list(self.model.tokenizer.encode(prompt))

    def _prepare(self, prefix: str, body: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
                 logprobs: int | None, prompt_param: str, max_tokens_param: str = "max_tokens") -> _Prepared:
        context = self.model.max_model_len
        outside = body.logit_bias_outside(self.model.vocab_size)
        if outside:
            raise bad_request(f"logit_bias keys {[str(t) for t in outside[:5]]} are outside the vocabulary "
                              f"[0, {self.model.vocab_size}) of this model; bias its token ids only",
                              param="logit_bias")
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        requests = []
        for i, token_ids in enumerate(prompts):
            if not token_ids:
                raise bad_request("the prompt is empty; give at least one token", param=prompt_param)
            room = context - len(token_ids)
            if room < 1:
                raise bad_request(f"the prompt has {len(token_ids)} tokens, but this model's context is {context} "
                                  "tokens and one must be left to generate; shorten the prompt", param=prompt_param,
                                  code="context_length_exceeded")
            wanted = room if max_tokens is None else max_tokens
            if wanted > room:
                raise bad_request(f"{max_tokens_param} is {wanted}, but the prompt's {len(token_ids)} tokens leave "
                                  f"room for {room} of this model's {context}-token context; lower {max_tokens_param} "
                                  "or shorten the prompt", param=max_tokens_param, code="context_length_exceeded")
            if body.min_tokens > wanted:
                raise bad_request(f"min_tokens is {body.min_tokens}, more than the {wanted} tokens this request may "
                                  f"generate ({max_tokens_param}, or the room the context leaves); lower min_tokens",
                                  param="min_tokens", code="min_tokens_exceed_max_tokens")
            try:
                params = body.sampling_params(wanted, logprobs)
            except RequestError as exc:
                raise _request_error(exc) from None
            requests.append((f"{response_id}-{i}", token_ids, params))
        return _Prepared(response_id, int(time.time()), requests, body.n, logprobs)

    async def _submit_chat(self, prepared: _Prepared, body: ChatCompletionRequest) -> tuple[_Prepared, asyncio.Queue]:
        """Submit; a request whose only constraint is tool_choice "auto"'s, refused
        because no structured-outputs backend here compiles it, goes on
        unconstrained: its calls are still read from the output."""
        try:
            return prepared, await self._submit(prepared, body)
        except APIError as exc:
            auto_constrained = body.tools and not body.forces_tool_call and body.response_format is None \
                and body.structured_outputs is None and prepared.requests[0][2].structured_outputs is not None
            if exc.code != INVALID_STRUCTURED_OUTPUT or not auto_constrained:
                raise
            log.warning("tool_choice auto goes unconstrained (calls are only parsed): %s", exc.message)
            free = [(rid, ids, dataclasses.replace(params, structured_outputs=None))
                    for rid, ids, params in prepared.requests]
            prepared = dataclasses.replace(prepared, requests=free)
            return prepared, await self._submit(prepared, body)

    async def _submit(self, prepared: _Prepared, body: SamplingFields) -> asyncio.Queue:
        limit = self.settings.max_waiting_requests
        if limit is not None and self.loop.num_queued + len(prepared.requests) > limit:
            raise APIError(503, f"the server is busy: {self.loop.num_queued} requests are already waiting (limit "
                           f"{limit}); retry after {self.settings.retry_after_s} s", code="server_busy",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        queue: asyncio.Queue = asyncio.Queue()
        submitted = []
        try:
            for request_id, token_ids, params in prepared.requests:
                # Only the one-engine loop serves adapters (kvforge serve refuses them with replicas).
                lora = {"lora_request": prepared.lora_request} if prepared.lora_request is not None else {}
                engine = await self.loop.submit(request_id, token_ids, params, queue, priority=body.priority,
                                                cache_salt=body.cache_salt, **lora)
                submitted.append(request_id)
                self.metrics.on_request(params.max_tokens, params.n, engine)
        except RequestError as exc:
            for request_id in submitted:
                self.loop.abort(request_id)
            raise _request_error(exc) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except Exception as exc:  # the engine failed to take a request it should have taken or refused
            for request_id in submitted:
                self.loop.abort(request_id)
            raise APIError(500, f"the engine could not take the request ({type(exc).__name__}: {exc}); the "
                           "server goes on serving, and its log has the traceback", code="generation_failed") from None
        return queue

    def _aborter(self, prepared: _Prepared):
        """Aborts whatever of `prepared` is unfinished; a no-op once all finished."""
        return lambda: [self.loop.abort(request_id) for request_id, _, _ in prepared.requests]

    # Streams

    async def _completion_events(self, prepared: _Prepared, body: CompletionRequest,
                                 outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        index_of = {rid: p for p, (rid, _, _) in enumerate(prepared.requests)}
        given = body.prompts() if body.echo else []
        tokens: dict[int, int] = {}  # choice index: its tokens so far
        offsets: dict[int, int] = {}  # choice index: its text length so far (logprobs' text_offset)
        done: set[int] = set()  # choices whose finish was sent
        head = {"id": prepared.response_id, "object": "text_completion", "created": prepared.created,
                "model": prepared.model}
        async for output in outputs:
            _raise_if_failed(output)
            for c in output.outputs:
                index = choice_index(index_of[output.request_id], prepared.n, c)
                if index in done or not (c.new_text or c.new_token_ids or c.finished):
                    continue
                if body.echo and index not in offsets:  # a choice's first chunk carries the prompt, as vLLM's
                    choice = self._echoed(body, given[index_of[output.request_id]], output, c)
                    offsets[index] = prompt_text_length(output.prompt_token_ids, self.token_text) + len(c.new_text)
                else:
                    choice = {"text": c.new_text, "finish_reason": c.finish_reason,
                              "logprobs": completion_logprobs(c, prepared.logprobs or 0, self.token_text, True,
                                                              offsets.get(index, 0))}
                    offsets[index] = offsets.get(index, 0) + len(c.new_text)
                tokens[index] = len(c.token_ids) if body.max_tokens != 0 else 0
                chunk = {**head, "choices": [{"index": index, **choice, "stop_reason": c.stop_reason}]}
                if body.continuous_usage:
                    chunk["usage"] = usage(prepared.num_prompt_tokens, sum(tokens.values()))
                if c.finished:
                    done.add(index)
                yield sse(chunk)
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": usage(prepared.num_prompt_tokens, sum(tokens.values()))})

    async def _chat_events(self, prepared: _Prepared, body: ChatCompletionRequest, reader: ToolCallReader | None,
                           outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        head = {"id": prepared.response_id, "object": "chat.completion.chunk", "created": prepared.created,
                "model": prepared.model}
        tokens: dict[int, int] = {}
        done: set[int] = set()
        calls = {index: ToolCallDeltas(reader) for index in range(prepared.n)} if reader is not None else {}
        for index in range(prepared.n):  # OpenAI opens each choice with the role
            yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for output in outputs:
            _raise_if_failed(output)
            for c in output.outputs:
                if c.index in done or not (c.new_text or c.new_token_ids or c.finished):
                    continue
                tokens[c.index] = len(c.token_ids)
                delta, finish_reason = {"content": c.new_text} if c.new_text or not c.finished else {}, c.finish_reason
                if c.index in calls:  # content and calls as far as the text so far tells them apart
                    delta = calls[c.index].delta(c.text, c.finished) or {}
                    if not (delta or c.finished or c.new_token_ids and prepared.logprobs is not None):
                        continue
                    if c.finished and calls[c.index].num_calls and c.finish_reason == "stop":
                        finish_reason = "tool_calls"
                chunk = {**head, "choices": [{
                    "index": c.index, "delta": delta,
                    "logprobs": chat_logprobs(c, prepared.logprobs or 0, self.token_text, True),
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason}]}
                if body.continuous_usage:
                    chunk["usage"] = usage(prepared.num_prompt_tokens, sum(tokens.values()))
                if c.finished:
                    done.add(c.index)
                yield sse(chunk)
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": usage(prepared.num_prompt_tokens, sum(tokens.values()))})


def _request_error(exc: RequestError) -> APIError:
    """A 400 for a refused request; one about its structured-outputs spec or its
    tool_choice says so in its code."""
    if str(exc).startswith("tool_choice"):
        return bad_request(str(exc), param="tool_choice", code=INVALID_TOOL_CHOICE)
    if STRUCTURED_OUTPUTS in str(exc):
        return bad_request(str(exc), param=STRUCTURED_OUTPUTS, code=INVALID_STRUCTURED_OUTPUT)
    return bad_request(str(exc))


def _raise_if_failed(output: RequestOutput) -> None:
    error = failed(output)
    if is_spec_error(error):  # the request's schema, regex or grammar: the client's to fix
        raise bad_request(error, param=STRUCTURED_OUTPUTS, code=INVALID_STRUCTURED_OUTPUT)
    if error is not None:
        raise APIError(500, f"generation failed: {error}", code="generation_failed")


async def _finals(outputs: AsyncIterator[RequestOutput]) -> dict[str, RequestOutput]:
    finals = {}
    async for output in outputs:
        if output.finished:
            finals[output.request_id] = output
    return finals


async def _until_disconnected(request: Request, work: Awaitable):
    """`work`'s result, or None if the client went away first; then `work` is
    cancelled, which aborts its requests."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return None
    try:
        return task.result()
    except EngineDeadError as exc:
        raise APIError(500, str(exc), code="engine_dead") from None


class _AbortingStream(StreamingResponse):
    """A stream that aborts its requests however the response ends, even when the
    client left before its first event (then its generator never started, so no
    `finally` of the generator runs)."""

    def __init__(self, content, abort):
        super().__init__(content, media_type="text/event-stream")
        self._abort = abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._abort()


def _event_stream(events: AsyncIterator[str], abort) -> StreamingResponse:
    """The events, then `[DONE]`; an error mid-stream becomes an error event, as
    vLLM sends it, since the status line has already gone out."""
    async def framed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield sse(exc.body())
        except EngineDeadError as exc:
            yield sse(error_body(500, str(exc), code="engine_dead"))
        yield SSE_DONE

    return _AbortingStream(framed(), abort)
