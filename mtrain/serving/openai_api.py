"""OpenAI's protocol: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

A request becomes a Plan (token ids of each prompt, n choices each, sampling, stop strings, log-probabilities),
runs as one scheduler Job, and is answered whole or, with "stream": true, as server-sent events:

    data: {"object": "text_completion", "choices": [{"index": 0, "text": " t5", ...}], ...}
    data: {... "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    data: {... "choices": [], "usage": {...}}          only with "stream_options": {"include_usage": true}
    data: [DONE]

Log-probabilities are those of the model's own distribution (before temperature, top_p and top_k). A completion
with "echo": true puts each prompt before its completion, with its tokens' log-probabilities when asked (the first
token has none), and takes "max_tokens": 0: how eval harnesses score a text's likelihood. Fields this
server has no use for are taken with their neutral values only (penalties 0, no logit_bias, no tools);
any other unknown field is refused, naming it. `top_k` is taken as an extension (0 or -1: no limit).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mtrain.generation import Emitted, Sampling
from mtrain.serving import fields
from mtrain.serving.fields import BadRequest
from mtrain.serving.scheduler import Job
from mtrain.serving.service import Service
from mtrain.serving.text import CONTEXT, GeneratedRow

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
          "logprobs", "user", "frequency_penalty", "presence_penalty", "logit_bias"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "parallel_tool_calls"}
NEUTRAL = {"frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None, {}),
           "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
           "tool_choice": (None, "none"), "response_format": (None, {"type": "text"})}
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # each token's check for a stop string's beginning costs its length squared
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Plan:
    chat: bool
    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: Sampling
    seed: int
    stops: list[str]
    top_logprobs: int | None
    stream: bool
    include_usage: bool
    echo: list[str] | None = None  # completions with "echo": the text of each prompt, put before its completion


def models(service: Service) -> dict:
    return {"object": "list", "data": [model(service.model_name, service)]}


def model(name: str, service: Service) -> dict:
    """GET /v1/models/NAME: the served model, or a 404."""
    if name != service.model_name:
        raise BadRequest(f'the model "{name}" does not exist: this server serves "{service.model_name}"', "model",
                         status=404, code="model_not_found")
    return {"id": name, "object": "model", "created": 0, "owned_by": "mtrain"}


def completion_plan(body: Any, service: Service) -> Plan:
    body = _object(body, COMPLETION_FIELDS, "a completion request")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest('"prompt" must be a string, a list of strings, a list of token ids or a list of such lists',
                         "prompt")
    service.check_rows(len(prompt), f"{len(prompt)} prompts", "prompt")
    ids = []
    for i, p in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            ids.append(service.encode(p, where))
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            ids.append(service.check_ids(p, where))
        else:
            raise BadRequest(f'{where} must be a string or a list of token ids (integers)', "prompt")
    logprobs = fields.number(body, "logprobs", None, int, 0, 20)
    plan = _plan(body, service, ids, chat=False, default_tokens=16, top_logprobs=logprobs,
                 fewest_tokens=0 if fields.boolean(body, "echo", False) else 1)
    if fields.boolean(body, "echo", False):
        plan.echo = [p if isinstance(p, str) else service.tokenizer.decode(i) for p, i in zip(prompt, ids)]
    return plan


def chat_plan(body: Any, service: Service) -> Plan:
    body = _object(body, CHAT_FIELDS, "a chat completion request")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest('"messages" must be a non-empty list of {"role": ..., "content": ...} objects', "messages")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    if service.chat_template is None:
        raise BadRequest(f"the model's tokenizer ({service.tokenizer.path}) has no chat template, so chat requests "
                         "cannot be formatted: use /v1/completions with your own prompt format", "messages")
    text = service.chat_template.render(checked)
    ids = service.encode(text, "messages", special=False)  # the template writes the special tokens itself
    if body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    wants = fields.boolean(body, "logprobs", False)
    top = fields.number(body, "top_logprobs", None, int, 0, 20)
    if top and not wants:
        raise BadRequest('"top_logprobs" needs "logprobs": true', "top_logprobs")
    room = service.model.config.max_position_embeddings - len(ids)
    default = max(1, min(room, service.limits.max_tokens_to_generate))
    return _plan(body, service, [ids], chat=True, default_tokens=default, top_logprobs=(top or 0) if wants else None)


def _plan(body: dict, service: Service, ids: list[list[int]], *, chat: bool, default_tokens: int,
          top_logprobs: int | None, fewest_tokens: int = 1) -> Plan:
    limits = service.limits
    max_tokens = fields.number(body, "max_tokens", default_tokens, int, fewest_tokens, limits.max_tokens_to_generate)
    temperature = fields.temperature(body, 1.0, 2.0)
    top_p = fields.number(body, "top_p", 1.0, float, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest('"top_p" must be greater than 0 (1 keeps every token)', "top_p")
    top_k = fields.number(body, "top_k", 0, int, -1, None)
    n = fields.number(body, "n", 1, int, 1, limits.max_prompts)
    service.check_rows(n * len(ids), f"{len(ids)} prompt(s) times n={n}", "n")
    for i, p in enumerate(ids):
        service.check_fits(p, max_tokens, "messages" if chat else f"prompt {i}", "max_tokens")
    seed = fields.number(body, "seed", None, int, -(2**63), 2**64 - 1)
    stream = fields.boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise BadRequest('"stream_options" is {"include_usage": true|false}, with "stream": true only',
                         "stream_options")
    include_usage = fields.boolean(options or {}, "include_usage", False)
    sampling = Sampling(greedy=temperature == 0 or top_k == 1, temperature=temperature,
                        top_k=top_k if top_k > 0 else None, top_p=top_p if top_p < 1 else None)
    stops = fields.string_list(body, "stop", most=MAX_STOPS, longest=MAX_STOP_CHARS)
    return Plan(chat, ids, n, max_tokens, sampling, secrets.randbits(63) if seed is None else seed % 2**64, stops,
                top_logprobs, stream, include_usage)


def _object(body: Any, known: set[str], what: str) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object ({what})")
    fields.unknown(body, known, what)
    for name, allowed in NEUTRAL.items():
        if name in known:
            fields.only_default(body, name, allowed, "is not supported")
    if not isinstance(body.get("user", ""), str):
        raise BadRequest('"user" must be a string', "user")
    return body


def check_model(body: Any, service: Service) -> None:
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object such as {"model": "...", "prompt": "Hello"}')
    name = body.get("model")
    if not isinstance(name, str):
        raise BadRequest(f'"model" must be a string: this server serves "{service.model_name}"', "model")
    model(name, service)


def _message(message: Any, i: int) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise BadRequest(f'{where} must be an object with a "role" among {", ".join(ROLES)}', "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise BadRequest(f'{where}: content parts must be {{"type": "text", "text": ...}} (this model reads text '
                             "only)", "messages")
        content = "".join(p["text"] for p in content)
    if content is None and message["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f'{where}.content must be a string or a list of text parts', "messages")
    out = {"role": message["role"], "content": content}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Run:
    """A Plan running as a scheduler job; `answer()` waits for the whole response, `events()` streams it."""

    def __init__(self, plan: Plan, service: Service):
        self.plan, self.service = plan, service
        self.id = f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        rows = [p for p in plan.prompts for _ in range(plan.n)]
        self.rows = [GeneratedRow(service.tokenizer, p, plan.max_tokens, service.eos_ids, plan.stops) for p in rows]
        self.echo = [t for t in plan.echo for _ in range(plan.n)] if plan.echo is not None else None
        self.prompt_tokens: list[list[Emitted]] = [[] for _ in rows]  # with echo and logprobs: the prompt's
        self.offsets = [0] * len(rows)  # text_offset of each row's next token
        # the tokens before each row's next one, to decode a token as the text it adds there (" world", not "world")
        self.context = [list(p[-CONTEXT:]) if self.echo is None else [] for p in rows]
        with_prompt = self.echo is not None and plan.top_logprobs is not None
        self.job = service.scheduler.submit(Job(rows, plan.max_tokens, plan.sampling, plan.seed, service.eos_ids,
                                                plan.top_logprobs, with_prompt))

    def _steps(self) -> Iterator[tuple[int, str, list[Emitted]]]:
        """(row, new text, the tokens it came from) as results arrive; each row's last has its finish_reason. With
        echo, each row's first is its prompt (and the prompt's tokens, the first without a log-probability)."""
        if self.echo is not None and not self.job.with_prompt_logprobs:
            for index, text in enumerate(self.echo):
                yield index, text, []
        for kind, value in self.job.results():
            if kind == "error":
                raise RuntimeError(value)
            if kind == "prompt_logprobs":
                for index, tokens in enumerate(value):
                    self.prompt_tokens[index] = [Emitted(index, self.job.prompts[index][0]), *tokens]
                    yield index, self.echo[index], self.prompt_tokens[index]
            elif kind == "tokens":
                taken: dict[int, tuple[str, list[Emitted]]] = {}
                for e in value:
                    row = self.rows[e.row]
                    if row.finish_reason:
                        continue
                    text, tokens = taken.get(e.row, ("", []))
                    taken[e.row] = (text + row.add(e), tokens + [e])
                    if row.finish_reason:
                        self.job.end_row(e.row)
                for index, (text, tokens) in taken.items():
                    yield index, text, tokens
            elif kind == "done":
                for index, row in enumerate(self.rows):
                    if not row.finish_reason:
                        yield index, row.end(), []

    def answer(self) -> dict:
        for _ in self._steps():
            pass
        choices = []
        for index, row in enumerate(self.rows):
            choice: dict[str, Any] = {"index": index}
            if self.plan.chat:
                choice["message"] = {"role": "assistant", "content": row.stream.text}
            else:
                choice["text"] = (self.echo[index] if self.echo else "") + row.stream.text
            choice["logprobs"] = self._logprobs(index, self.prompt_tokens[index] + row.emitted)
            choice["finish_reason"] = row.finish_reason
            choices.append(choice)
        return {**self._head(), "choices": choices, "usage": self._usage()}

    def events(self) -> Iterator[str]:
        """The server-sent events of the response; the job is cancelled if the client goes away."""
        try:
            if self.plan.chat:
                for index in range(len(self.rows)):
                    yield self._event([{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            try:
                for index, text, tokens in self._steps():
                    row = self.rows[index]
                    logprobs = self._logprobs(index, tokens) if tokens else None
                    if text or logprobs or row.finish_reason:
                        content = {"delta": {"content": text}} if self.plan.chat else {"text": text}
                        yield self._event([{"index": index, **content, "logprobs": logprobs,
                                            "finish_reason": row.finish_reason}])
            except RuntimeError as e:
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
                return
            if self.plan.include_usage:
                yield self._event([], usage=self._usage())
            yield "data: [DONE]\n\n"
        finally:
            self.job.cancel()

    def _head(self) -> dict:
        kind = ("chat.completion" if self.plan.chat else "text_completion")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.service.model_name,
                "system_fingerprint": None}

    def _event(self, choices: list[dict], usage: dict | None = None) -> str:
        head = self._head()
        if self.plan.chat:
            head["object"] = "chat.completion.chunk"
        chunk = {**head, "choices": choices}
        if self.plan.include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.plan.prompts)
        completion = sum(len(r.emitted) for r in self.rows)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, index: int, tokens: list[Emitted]) -> dict | None:
        """The logprobs of row `index`'s `tokens` (the next ones of its response): OpenAI's chat or completion
        shape. A token without a log-probability (echo's first) has null for it and its top ones."""
        if self.plan.top_logprobs is None:
            return None
        texts, tops = [], []
        for e in tokens:
            piece = self._decoder(index)
            texts.append(piece(e.token))
            tops.append([(piece(t), lp) for t, lp in e.top])
            self.context[index] = (self.context[index] + [e.token])[-CONTEXT:]
        if self.plan.chat:
            return {"content": [{**_entry(text, e.logprob), "top_logprobs": [_entry(t, lp) for t, lp in top]}
                                for e, text, top in zip(tokens, texts, tops)]}
        offsets = []
        for t in texts:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(t)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in tokens],
                "top_logprobs": [None if e.logprob is None else dict(top) for e, top in zip(tokens, tops)],
                "text_offset": offsets}

    def _decoder(self, index: int) -> Callable[[int], str]:
        """token -> the text it adds after row `index`'s context."""
        decode, context = self.service.tokenizer.decode, self.context[index]
        before = decode(context) if context else ""

        def piece(token: int) -> str:
            text = decode(context + [token])
            return text[len(before):] if text.startswith(before) else decode([token])

        return piece


def _entry(text: str, logprob: float | None) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
