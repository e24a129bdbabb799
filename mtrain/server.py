"""`mtrain serve`: a REST text-generation server shaped like Megatron-LM's (PUT /api), on Flask.

    PUT /api   {"prompts": ["Once upon a time", ...], "tokens_to_generate": 32,
                "temperature": 1.0, "top_k": 0, "top_p": 0.9, "random_seed": 1234}      (only "prompts" needed)
    200        {"text": ["Once upon a time there was ...", ...]}    each prompt followed by its continuation
    400        {"error": "..."}    not a JSON object, a missing / unknown / mistyped / out-of-range field, a prompt
                                   too long for the model's positions
    413        {"error": "..."}    a body over the size limit          405: another method than PUT

Sampling: temperature 0 is greedy (so is top_k 1); top_k 0 and top_p 0 (or 1) mean no restriction. Requests are
served one generation at a time (the prompts of one request run as one batch, see generation.py).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from mtrain.data.tokenizer import Tokenizer
from mtrain.errors import TrainError
from mtrain.generation import Sampling, check_fits, generate_batch
from mtrain.models.model import Transformer

FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "random_seed")
DEFAULT_TOKENS = 64  # Megatron-LM's default tokens_to_generate


class BadRequest(TrainError):
    """A request the server answers with 400 and this message."""


@dataclass(frozen=True)
class Limits:
    max_prompts: int = 32
    max_tokens_to_generate: int = 1024
    max_request_bytes: int = 1 << 20


@dataclass(frozen=True)
class Request:
    prompts: list[str]
    tokens_to_generate: int
    sampling: Sampling
    seed: int


def parse_request(body: Any, limits: Limits) -> Request:
    """Check every field of a request body (decoded JSON); BadRequest names the first problem."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object such as {"prompts": ["Hello"], "tokens_to_generate": 16}')
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; fields: {', '.join(FIELDS)}")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest('"prompts" must be a non-empty list of strings')
    if len(prompts) > limits.max_prompts:
        raise BadRequest(f'"prompts" has {len(prompts)} entries; this server takes at most {limits.max_prompts}')
    tokens = _number(body, "tokens_to_generate", DEFAULT_TOKENS, int, 0, limits.max_tokens_to_generate)
    temperature = _number(body, "temperature", 1.0, float, 0.0, 100.0)
    top_k = _number(body, "top_k", 0, int, 0, None)
    top_p = _number(body, "top_p", 0.0, float, 0.0, 1.0)
    seed = _number(body, "random_seed", 0, int, 0, 2**63 - 1)
    sampling = Sampling(greedy=temperature == 0 or top_k == 1, temperature=temperature, top_k=top_k or None,
                        top_p=top_p if 0 < top_p < 1 else None)
    return Request(prompts, tokens, sampling, seed)


def _number(body: dict, name: str, default: Any, kind: type, low: float, high: float | None) -> Any:
    value = body.get(name, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok or value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise BadRequest(f'"{name}" must be {"an integer" if kind is int else "a number"} {bounds}, got {value!r}')
    return kind(value)


class TextGenerator:
    """The model and tokenizer behind the server: text in, text out, one generation at a time."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, eos_ids: Collection[int] = ()):
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, tuple(eos_ids)
        self.lock = threading.Lock()

    def complete(self, request: Request) -> list[str]:
        ids = [self.tokenizer.encode(p) for p in request.prompts]
        for i, p in enumerate(ids):
            if not p:
                raise BadRequest(f"prompt {i} encodes to no tokens")
            try:
                check_fits(self.model.config, len(p), request.tokens_to_generate)
            except TrainError as e:
                raise BadRequest(f"prompt {i}: {e}") from None
        with self.lock:
            new = generate_batch(self.model, ids, max_new_tokens=request.tokens_to_generate,
                                 sampling=request.sampling, seed=request.seed, eos_ids=self.eos_ids)
        return [self.tokenizer.decode(p + n) for p, n in zip(ids, new)]


def check_installed() -> None:
    """Flask is an optional extra: say how to get it before any model is loaded."""
    try:
        import flask  # noqa: F401
    except ImportError:
        raise TrainError("mtrain serve needs Flask: pip install 'mconvert[serve]'") from None


def create_app(generator: TextGenerator, limits: Limits = Limits()):
    """The Flask application: PUT /api."""
    check_installed()
    from flask import Flask, jsonify, request
    from werkzeug.exceptions import HTTPException

    app = Flask("mtrain")
    app.config["MAX_CONTENT_LENGTH"] = limits.max_request_bytes

    @app.put("/api")
    def api():
        body = request.get_json(force=True, silent=True)  # None for a body that is not JSON
        try:
            return jsonify({"text": generator.complete(parse_request(body, limits))})
        except BadRequest as e:
            return jsonify({"error": str(e)}), 400

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        message = e.description
        if e.code == 413:
            message = f"the request body is larger than this server's limit of {limits.max_request_bytes} bytes"
        return jsonify({"error": message}), e.code

    return app


def serve(app, host: str, port: int, announce) -> None:
    """Serve until interrupted; `announce(url)` is called once the socket listens (port 0: a free port)."""
    from werkzeug.serving import make_server

    server = make_server(host, port, app, threaded=True)
    announce(f"http://{host}:{server.server_port}/api")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
