"""`mtrain serve` under crafted requests (issue 29, "Manner"): every one gets a 4xx with a message naming what is
wrong (400; 413 for a body over the limit, chunked or not), never a 500, a traceback or a hang, and the server
answers normally afterwards. Raw bytes go through http.client, so nothing is cleaned up by a client library."""

from __future__ import annotations

import http.client
import json
import socket
from datetime import datetime
from urllib.parse import urlsplit

import pytest

from mtrain.serving.body import MAX_DEPTH
from mtrain.serving.chat_template import ChatTemplate
from mtrain.serving.fields import BadRequest
from tests.support.models import save_hf
from tests.support.server import request, running_server

pytest.importorskip("flask")
LIMIT = 8192  # --max-request-bytes
COMPLETIONS = b'{"model": "tiny", "prompt": %s, "max_tokens": 2%s}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    hf = save_hf("llama", tmp_path_factory.mktemp("serve-adv") / "tiny", seed=5)
    with running_server(hf, "--max-request-bytes", str(LIMIT)) as s:
        yield s
        assert request(s.url + "/health", method="GET") == (200, {"status": "ok"})
        code, err = s.stop()
        assert code == 0 and "Traceback" not in err, err[-3000:]


def send(url: str, path: str, body: bytes, *, chunked: bool = False, method: str = "POST",
         headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of `body` sent as it is (chunked: in 1000-byte chunks, no Content-Length)."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=120)
    try:
        if chunked:
            pieces = [body[i:i + 1000] for i in range(0, len(body), 1000)]
            conn.request(method, path, body=iter(pieces), encode_chunked=True,
                         headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        else:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def openai_refused(server, body: bytes, *needles: str, status: int = 400, **kw) -> dict:
    got, answer = send(server.url, "/v1/completions", body, **kw)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    for needle in needles:
        assert needle in error["message"], error
    return error


@pytest.mark.parametrize("value, needle", [
    (b"NaN", "holds NaN, which is not a JSON number"),
    (b"-Infinity", "holds -Infinity, which is not a JSON number"),
    (b"1e400", '"temperature" must be a number from 0.0 to 2.0, got Infinity'),
    (b"5e-324", '"temperature" must be 0 (greedy) or at least 1e-05, got 5e-324'),
    (b"2.2250738585072014e-308", "must be 0 (greedy) or at least 1e-05"),
    (b"1" * 5000, "the body is not JSON this server reads"),  # more digits than Python converts
    (b"true", '"temperature" must be a number'),
])
def test_temperatures_that_are_not_numbers_a_sampler_can_use(server, value, needle):
    openai_refused(server, COMPLETIONS % (b'"t5"', b', "temperature": ' + value), needle)
    got, answer = send(server.url, "/api", b'{"prompts": ["t5"], "temperature": %s}' % value, method="PUT")
    assert got == 400 and ("temperature" in answer["error"] or "JSON" in answer["error"]), answer


@pytest.mark.parametrize("body, needle, param", [
    (COMPLETIONS % (b'"t5 \\ud800"', b""), "\"prompt\" holds a lone surrogate ('\\ud800')", "prompt"),
    (COMPLETIONS % (b'"t5"', b', "stop": ["\\udfff"]'), "lone surrogate ('\\udfff')", "stop"),
    (COMPLETIONS % (b'"t5"', b', "\\ud800": 1'), "a key of body holds a lone surrogate", None),
    (b'{"model": "tiny", "prompt": "t5 \xff\xfe"}', "the body is not UTF-8 text (byte 32 is invalid)", None),
    (b'{"model": "tiny", "prompt": "t5 \xed\xa0\x80"}', "not UTF-8", None),  # a surrogate encoded as UTF-8
])
def test_text_that_is_not_unicode(server, body, needle, param):
    assert openai_refused(server, body, needle)["param"] == param


def test_deeply_nested_bodies(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    openai_refused(server, COMPLETIONS % (deep[:4000] + deep[-4000:], b""), "nests 4001 levels", "at most 32")
    got, answer = send(server.url, "/api", b'{"prompts": %s}' % (b"[" * 3000 + b"]" * 3000), method="PUT")
    assert got == 400 and answer["error"].startswith("the body nests 3001 levels"), answer
    # brackets inside strings are text, not nesting; 32 levels of lists are JSON the server reads (then refuses)
    assert send(server.url, "/v1/completions", COMPLETIONS % (b'"t5 ' + b"[{" * 1000 + b'"', b""))[0] == 200
    nested = b"[" * (MAX_DEPTH - 1) + b"5" + b"]" * (MAX_DEPTH - 1)
    openai_refused(server, COMPLETIONS % (nested, b""), "must be a string or a list of token ids")


@pytest.mark.parametrize("prompt, needle", [
    (b"[5, 300]", "prompt holds token id 300, outside the model's vocabulary of 300 (ids 0 to 299)"),
    (b"[-1]", "prompt holds token id -1, outside"),
    (b"[5, 1000000000000000000000000000000]", "prompt holds token id 1000000000000000000000000000000"),
    (b'[[5], [7, 99999]]', "prompt[1] holds token id 99999"),
    (b"[5.0]", "prompt must be a string or a list of token ids (integers)"),
    (b"[true]", "prompt must be a string or a list of token ids (integers)"),
    (b"[[]]", "prompt holds no tokens"),
    (b'""', "prompt encodes to no tokens"),
])
def test_token_ids_outside_the_vocabulary(server, prompt, needle):
    assert openai_refused(server, COMPLETIONS % (prompt, b""), needle)["param"] == "prompt"


def test_oversized_bodies_get_413_chunked_or_not(server):
    big = COMPLETIONS % (b'"' + b"t5 " * (2 * LIMIT) + b'"', b"")
    message = f"the request body is larger than this server's limit of {LIMIT} bytes"
    assert openai_refused(server, big, message, status=413, chunked=True)["param"] is None
    openai_refused(server, big, message, status=413)
    got, answer = send(server.url, "/api", b'{"prompts": ["' + b"t5 " * (2 * LIMIT) + b'"]}', chunked=True,
                       method="PUT")
    assert (got, answer) == (413, {"error": message})
    # a body within the limit sent chunked is read whole
    assert send(server.url, "/v1/completions", COMPLETIONS % (b'"t5 t6"', b""), chunked=True)[0] == 200


@pytest.mark.parametrize("head, body, status, needle", [
    (b"Content-Length: -5", b"{}", 400, "the body is not JSON"),
    (b"Content-Length: abc", b"{}", 400, "the body is not JSON"),
    (b"Transfer-Encoding: chunked", b"zz\r\nabc\r\n0\r\n\r\n", 400, "the request could not be read as HTTP"),
    (b"Content-Length: 1000000000", b"{}", 413, "larger than this server's limit"),
])
def test_malformed_http(server, head, body, status, needle):
    """Headers that lie or do not parse; the answer comes at once (the connection is closed after it)."""
    host, port = urlsplit(server.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=120) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + head + b"\r\n\r\n" + body)
        answer = b""
        while piece := conn.recv(1 << 16):
            answer += piece
    line, _, rest = answer.partition(b"\r\n")
    assert line.split()[1] == str(status).encode()
    assert needle in json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["message"]


@pytest.mark.parametrize("extra, needle, param", [
    (b', "n": true', '"n" must be an integer', "n"),
    (b', "max_tokens": 2.5', '"max_tokens" must be an integer', "max_tokens"),
    (b', "stop": [1]', '"stop" must be a string or a list of at most 4 strings', "stop"),
    (b', "stop": "%s"' % (b"ab" * 200), '"stop" holds a string of 400 characters; at most 256 are accepted', "stop"),
    (b', "seed": 18446744073709551616', '"seed" must be an integer', "seed"),
    (b', "logprobs": 21', '"logprobs" must be an integer from 0 to 20', "logprobs"),
    (b', "stream_options": {"include_usage": true}', '"stream_options" is {"include_usage"', "stream_options"),
    (b', "logit_bias": {"5": 100}', '"logit_bias" is not supported', "logit_bias"),
])
def test_mistyped_fields(server, extra, needle, param):
    assert openai_refused(server, COMPLETIONS % (b'"t5"', extra), needle)["param"] == param


def test_chat_messages_of_the_wrong_shape(server):
    for messages, needle in ((b'"hi"', '"messages" must be a non-empty list'),
                             (b'[{"role": "user"}]', "messages[0].content must be a string"),
                             (b'[{"role": "user", "content": [{"type": "image_url"}]}]', "content parts must be"),
                             (b'[{"role": {"$ne": 1}, "content": "t5"}]', 'must be an object with a "role"')):
        got, answer = send(server.url, "/v1/chat/completions", b'{"model": "tiny", "messages": %s}' % messages)
        assert got == 400 and needle in answer["error"]["message"], answer


def test_methods_and_paths_answer_in_json(server):
    assert send(server.url, "/v1/completions", b"", method="DELETE")[0] == 405
    got, answer = send(server.url, "/v1/../../etc/passwd", b"", method="GET")
    assert got == 404 and "no such path" in json.dumps(answer)


def test_a_chat_template_is_sandboxed(tmp_path, marker):
    """A checkpoint's chat template reaching for Python objects or raising is a 400 about the template, and
    what it tried never runs."""
    payload = ("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
               "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(BadRequest, match="the model's chat template .* failed on these messages: SecurityError"):
        ChatTemplate(payload, tmp_path / "tokenizer_config.json", {}).render([{"role": "user", "content": "x"}])
    dated = ChatTemplate("{{ bos_token }}{{ strftime_now('%Y') }}", tmp_path, {"bos_token": "<s>"})
    before = datetime.now().year
    assert dated.render([]) in (f"<s>{before}", f"<s>{datetime.now().year}")  # transformers' functions work
    refuse = ChatTemplate("{{ raise_exception('no system role') }}", tmp_path, {})
    with pytest.raises(BadRequest, match="the model's chat template refused these messages: no system role"):
        refuse.render([{"role": "system", "content": "x"}])
