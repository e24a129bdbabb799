"""The HTTP side of `mtrain serve` (Flask on Werkzeug's threaded server): routes, body limits, error shapes, and
a clean stop on Ctrl-C or SIGTERM (exit 0).

    GET  /health                 {"status": "ok"}
    PUT  /api  (POST as well)    Megatron-LM's text generation request (megatron_api.py)
    GET  /v1/models[/NAME]       POST /v1/completions, /v1/chat/completions: OpenAI's protocol (openai_api.py)

Errors: {"error": "message"} on /api and /health, OpenAI's {"error": {"message", "type", "param", "code"}} on
/v1/*; 400 for a bad request (body.py, fields.py), 404 for an unknown path or model, 405 for a wrong method, 413
for a body over --max-request-bytes (chunked bodies too: reading stops at the limit), 503 while
--max-concurrent-requests are being served, 500 for a failure of ours.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from mtrain.errors import TrainError
from mtrain.serving import megatron_api, openai_api
from mtrain.serving.body import parse_json
from mtrain.serving.fields import BadRequest
from mtrain.serving.service import Service

SOCKET_TIMEOUT = 120  # seconds a connection may stay silent


def check_installed() -> None:
    """Flask is an optional extra: say how to get it before any model is loaded."""
    try:
        import flask  # noqa: F401
    except ImportError:
        raise TrainError("mtrain serve needs Flask: pip install 'mconvert[serve]'") from None


def create_app(service: Service):
    check_installed()
    from flask import Flask, Response, jsonify, request
    from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

    app = Flask("mtrain")
    limit = service.limits.max_request_bytes
    app.config["MAX_CONTENT_LENGTH"] = limit

    def body() -> Any:
        """The decoded JSON body, read up to the limit whatever the headers say (a chunked body has no length)."""
        if request.content_length is not None and request.content_length > limit:
            raise RequestEntityTooLarge()
        pieces, size = [], 0
        while piece := request.stream.read(min(1 << 16, limit + 1 - size)):
            pieces.append(piece)
            size += len(piece)
            if size > limit:
                raise RequestEntityTooLarge()
        return parse_json(b"".join(pieces))

    def openai_error(message: str, status: int, kind: str, param: str | None = None, code: str | None = None):
        return jsonify(openai_api.error_body(message, kind, param, code)), status

    @app.get("/health")
    def health():
        return jsonify({"status": "ok"})

    @app.route("/api", methods=["PUT", "POST"])
    def megatron():
        try:
            return jsonify(megatron_api.answer(body(), service))
        except BadRequest as e:
            return jsonify({"error": str(e)}), e.status

    @app.get("/v1/models")
    def models():
        return jsonify(openai_api.models(service))

    @app.get("/v1/models/<path:name>")
    def one_model(name: str):
        try:
            return jsonify(openai_api.model(name, service))
        except BadRequest as e:
            return openai_error(str(e), e.status, "not_found_error", e.param, e.code)

    def openai(make_plan: Callable):
        try:
            data = body()
            openai_api.check_model(data, service)
            plan = make_plan(data, service)
            run = openai_api.Run(plan, service)  # submits it: 503 when the server is busy
        except BadRequest as e:
            kind = {404: "not_found_error", 503: "server_error"}.get(e.status, "invalid_request_error")
            return openai_error(str(e), e.status, kind, e.param, e.code)
        if plan.stream:
            return Response(run.events(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
        return jsonify(run.answer())

    app.post("/v1/completions", endpoint="completions")(lambda: openai(openai_api.completion_plan))
    app.post("/v1/chat/completions", endpoint="chat")(lambda: openai(openai_api.chat_plan))

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        message = e.description
        if e.code == 413:
            message = f"the request body is larger than this server's limit of {limit} bytes"
        elif e.code == 405:
            allowed = ", ".join(sorted(e.valid_methods or []))
            message = f"{request.method} is not allowed on {request.path}: use {allowed}"
        elif e.code == 400:  # from Werkzeug: what it could not read, such as a malformed chunked body
            message = f"the request could not be read as HTTP (malformed headers or chunked body): {e.description}"
        elif e.code == 404:
            message = f"no such path {request.path}: the server answers /health, /api, /v1/models, " \
                      "/v1/completions and /v1/chat/completions"
        if request.path.startswith("/v1/"):
            kind = {404: "not_found_error", 413: "invalid_request_error"}.get(e.code, "invalid_request_error")
            return openai_error(message, e.code or 400, kind)
        return jsonify({"error": message}), e.code

    @app.errorhandler(Exception)
    def failure(e: Exception):
        traceback.print_exception(e, file=sys.stderr)
        message = f"the server failed on this request: {type(e).__name__}: {e}"
        if request.path.startswith("/v1/"):
            return openai_error(message, 500, "server_error")
        return jsonify({"error": message}), 500

    return app


def serve(app, host: str, port: int, announce: Callable[[str], None]) -> None:
    """Serve until Ctrl-C or SIGTERM, then return (no traceback, no "Aborted!"); `announce(url)` is called once the
    socket listens (port 0: a free port)."""
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Handler(WSGIRequestHandler):
        timeout = SOCKET_TIMEOUT  # a client that stops sending (or reading) mid-request frees its thread

    server = make_server(host, port, app, threaded=True, request_handler=Handler)
    stopping = threading.Event()

    def stop(signum, frame):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        announce(f"http://{host}:{server.server_port}")
        server.serve_forever()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.server_close()
