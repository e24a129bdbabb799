"""`mtrain serve`: a real server process on a free localhost port answers PUT /api like Megatron-LM's text
generation server, with clear 4xx errors for bad requests and a bound on their size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mtrain.data.tokenizer import load_tokenizer
from mtrain.generation import Sampling, generate_batch
from mtrain.inference import load_model
from mtrain.server import BadRequest, Limits, parse_request
from tests.support.models import save_hf

pytest.importorskip("flask")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m mtrain serve --port 0` (any free port); yields (url, checkpoint)."""
    hf = save_hf("llama", tmp_path_factory.mktemp("serve") / "hf", seed=5)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mtrain", "serve", "--load", str(hf), "--host", "127.0.0.1",
                             "--port", "0", "--max-prompts", "4", "--max-request-bytes", "4096"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # "serving … at http://127.0.0.1:PORT/api (PUT; Ctrl-C stops)"
        assert " at http://127.0.0.1:" in line, line + proc.stderr.read()[-3000:]
        yield line.split(" at ")[1].split()[0], hf
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def put(url: str, body, method: str = "PUT") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_generates_like_the_library(server):
    url, hf = server
    prompts = ["t5 t37 t42 t8", "t9 t3"]
    status, answer = put(url, {"prompts": prompts, "tokens_to_generate": 8, "temperature": 0})
    assert status == 200 and set(answer) == {"text"}
    model, _ = load_model(hf)
    tok = load_tokenizer(hf)
    ids = [tok.encode(p) for p in prompts]
    new = generate_batch(model, ids, max_new_tokens=8, sampling=Sampling(greedy=True), eos_ids=[tok.eod_id])
    assert answer["text"] == [tok.decode(p + n) for p, n in zip(ids, new)]
    assert answer["text"][0].startswith("t5 t37 t42 t8 t")
    sampled = [put(url, {"prompts": ["t5"], "tokens_to_generate": 6, "top_p": 0.9, "random_seed": s})[1]["text"][0]
               for s in (1, 1, 2, 3)]
    assert sampled[0] == sampled[1] and len(set(sampled)) > 1  # the seed decides


@pytest.mark.parametrize("body, status, message", [
    (b"not json", 400, "the body must be a JSON object"),
    ({"prompt": ["t5"]}, 400, "unknown field(s) prompt; fields: prompts, tokens_to_generate, temperature, top_k, "
                              "top_p, random_seed"),
    ({"prompts": "t5"}, 400, '"prompts" must be a non-empty list of strings'),
    ({"prompts": ["t5"] * 5}, 400, '"prompts" has 5 entries; this server takes at most 4'),
    ({"prompts": ["t5"], "tokens_to_generate": -1}, 400, '"tokens_to_generate" must be an integer from 0 to 1024'),
    ({"prompts": ["t5"], "temperature": "hot"}, 400, '"temperature" must be a number from 0.0 to 100.0'),
    ({"prompts": ["t5"], "top_p": 1.5}, 400, '"top_p" must be a number from 0.0 to 1.0, got 1.5'),
    ({"prompts": ["t5 t6", "t7"], "tokens_to_generate": 300}, 400,
     "prompt 0: a prompt of 2 tokens plus 300 new tokens needs 302 positions; the model has 256"),
    ({"prompts": ["t5 " * 2000]}, 413, "the request body is larger than this server's limit of 4096 bytes"),
])
def test_bad_requests_get_clear_errors(server, body, status, message):
    got, answer = put(server[0], body)
    assert got == status and answer["error"].startswith(message), answer


def test_other_methods_and_paths(server):
    url = server[0]
    assert put(url, {"prompts": ["t5"]}, method="POST")[0] == 405
    assert put(url.removesuffix("/api") + "/nope", {"prompts": ["t5"]})[0] == 404


def test_parse_request_defaults():
    r = parse_request({"prompts": ["a"]}, Limits())
    assert (r.tokens_to_generate, r.sampling, r.seed) == (64, Sampling(temperature=1.0), 0)
    assert parse_request({"prompts": ["a"], "top_k": 1}, Limits()).sampling.is_greedy
    with pytest.raises(BadRequest, match='"top_k" must be an integer of at least 0, got 2.5'):
        parse_request({"prompts": ["a"], "top_k": 2.5}, Limits())


def test_serve_refuses_a_missing_tokenizer(tmp_path):
    from click.testing import CliRunner

    from mtrain.cli import main

    hf = save_hf("llama", tmp_path / "hf", seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).unlink(missing_ok=True)
    result = CliRunner().invoke(main, ["serve", "--load", str(hf), "--port", "0"], catch_exceptions=False)
    assert result.exit_code == 1
    assert f"Error: {hf} carries no tokenizer files: pass --tokenizer DIR (prompts are text)" in result.output
