"""PUT /api (POST too), answered as Megatron-LM's text generation server answers it.

    {"prompts": ["Once upon a time", ...], "tokens_to_generate": 32, "temperature": 1.0, "top_k": 0,
     "top_p": 0.9, "random_seed": 1234, "logprobs": false, "add_BOS": false, "stop_on_eol": false,
     "stop_on_double_eol": false, "stop_token": null, "no_log": false}                  (only "prompts" needed)
    -> {"text": [prompt + continuation, ...], "segments": [[token text, ...], ...], "logprobs": null}

"logprobs": true returns, per prompt, the log-probability of every token after the first (prompt and
continuation) given those before it. Megatron's other fields are taken with their neutral values only
(prevent_newline_after_colon false, top_p_decay 0, top_p_bound 0, beam_width null, length_penalty 1).
"""

from __future__ import annotations

from typing import Any

from mtrain.generation import Emitted, Sampling
from mtrain.serving import fields
from mtrain.serving.chat_template import special_tokens
from mtrain.serving.fields import BadRequest
from mtrain.serving.scheduler import Job
from mtrain.serving.service import Service
from mtrain.serving.text import GeneratedRow

DEFAULT_TOKENS = 64  # Megatron-LM's default tokens_to_generate
NEUTRAL = {"prevent_newline_after_colon": (False,), "top_p_decay": (0, 0.0), "top_p_bound": (0, 0.0),
           "beam_width": (None,), "length_penalty": (1, 1.0)}
FIELDS = {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "random_seed", "logprobs", "add_BOS",
          "stop_on_eol", "stop_on_double_eol", "stop_token", "no_log", *NEUTRAL}


def answer(body: Any, service: Service) -> dict:
    """The response to a request body (decoded JSON); BadRequest names the first problem."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object such as {"prompts": ["Hello"], "tokens_to_generate": 16}')
    fields.unknown(body, FIELDS, "the request")
    for name, allowed in NEUTRAL.items():
        fields.only_default(body, name, allowed, "is not supported")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest('"prompts" must be a non-empty list of strings', "prompts")
    limits = service.limits
    if len(prompts) > limits.max_prompts:
        raise BadRequest(f'"prompts" has {len(prompts)} entries; this server takes at most {limits.max_prompts}',
                         "prompts")
    tokens = fields.number(body, "tokens_to_generate", DEFAULT_TOKENS, int, 0, limits.max_tokens_to_generate)
    temperature = fields.temperature(body, 1.0, 100.0)
    top_k = fields.number(body, "top_k", 0, int, 0, None)
    top_p = fields.number(body, "top_p", 0.0, float, 0.0, 1.0)
    seed = fields.number(body, "random_seed", 0, int, 0, 2**63 - 1)
    logprobs = fields.boolean(body, "logprobs", False)
    add_bos = fields.boolean(body, "add_BOS", False)
    fields.boolean(body, "no_log", False)  # nothing is logged either way
    stops = ["\n\n"] if fields.boolean(body, "stop_on_double_eol", False) else []
    stops += ["\n"] if fields.boolean(body, "stop_on_eol", False) else []
    stop_token = fields.number(body, "stop_token", None, int, 0, service.model.config.vocab_size - 1)
    sampling = Sampling(greedy=temperature == 0 or top_k == 1, temperature=temperature, top_k=top_k or None,
                        top_p=top_p if 0 < top_p < 1 else None)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(_with_bos(service, p, i) if add_bos else service.encode(p, f"prompt {i}"))
        service.check_fits(ids[-1], tokens, f"prompt {i}", "tokens_to_generate")
    eos = service.eos_ids | ({stop_token} if stop_token is not None else set())
    job = service.scheduler.submit(Job(ids, tokens, sampling, seed, eos, 0 if logprobs else None, logprobs))
    rows = [GeneratedRow(service.tokenizer, p, tokens, (), stops, keep_stop=True) for p in ids]
    prompt_lp: list[list[Emitted]] = []
    for kind, value in job.results():
        if kind == "prompt_logprobs":
            prompt_lp = value
        elif kind == "tokens":
            for e in value:
                rows[e.row].add(e)
                if rows[e.row].finish_reason:
                    job.end_row(e.row)
        elif kind == "error":
            raise RuntimeError(value)
    tok = service.tokenizer
    text = [tok.decode(p + r.tokens) if not r.stream.stopped else tok.decode(p) + r.stream.text
            for p, r in zip(ids, rows)]
    segments = [[tok.decode([t]) for t in p + r.tokens] for p, r in zip(ids, rows)]
    out = {"text": text, "segments": segments, "logprobs": None}
    if logprobs:
        out["logprobs"] = [[e.logprob for e in lp + r.emitted] for lp, r in zip(prompt_lp, rows)]
    return out


def _with_bos(service: Service, prompt: str, i: int) -> list[int]:
    bos = bos_id(service)
    if bos is None:
        raise BadRequest("add_BOS: the tokenizer names no BOS token", "add_BOS")
    ids = service.tokenizer.encode(prompt, special=False)
    return ids if ids[:1] == [bos] else [bos, *ids]


def bos_id(service: Service) -> int | None:
    tok = service.tokenizer
    if tok.kind == "sentencepiece":
        bos = tok.impl.bos_id()
        return bos if bos >= 0 else None
    if tok.kind == "transformers":
        return tok.impl.bos_token_id
    text = special_tokens(tok)["bos_token"]
    return tok.impl.token_to_id(text) if text else None
