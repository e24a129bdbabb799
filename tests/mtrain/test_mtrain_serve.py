"""`mtrain serve`: a real server process on a free localhost port answers Megatron-LM's PUT /api and OpenAI's
/v1 endpoints (checked with the official `openai` client: plain, streamed, chat), with clear 4xx errors, and stops
cleanly on Ctrl-C. The scheduler's batching and interleaving are checked in-process with a model that steps only
when the test lets it (no timing involved)."""

from __future__ import annotations

import copy
import json
import threading
import urllib.request

import pytest
import torch

from mtrain.data.tokenizer import load_tokenizer
from mtrain.generation import Sampling, generate_batch, prompt_logprobs
from mtrain.inference import load_model
from mtrain.serving.fields import BadRequest
from mtrain.serving.scheduler import Job, Scheduler
from tests.mtrain.parity import EPS32, FLOOR_ULPS, K
from tests.support.models import save_hf
from tests.support.server import request, running_server

pytest.importorskip("flask")
openai = pytest.importorskip("openai")

# the chat template written beside the test tokenizer (a WordLevel one: only "tN" words are in its vocabulary)
TEMPLATE = ("{{ bos_token }}{% for m in messages %} t4 {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %} t3{% endif %}")
EOS = 2  # the test tokenizer's eos token t2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = save_hf("llama", tmp_path_factory.mktemp("serve") / "tiny", seed=5)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return hf


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint, "--max-prompts", "4", "--max-request-bytes", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(model, tokenizer, greedy(ids, n) -> the new ids generate_batch gives, eos kept)."""
    model, _ = load_model(checkpoint)
    tok = load_tokenizer(checkpoint)

    def greedy(ids, n):
        return generate_batch(model, [ids], max_new_tokens=n, sampling=Sampling(greedy=True), eos_ids=[EOS])[0]

    return model, tok, greedy


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_within_float32_error(served: list[float], model, ids: list[int]) -> None:
    """`served`: the log-probability of each token of `ids` after the first, computed by the server in float32.
    The exact values are the same model's in float64; the server's sums run in other orders (another thread count,
    the key/value cache) than this process's float32 evaluation, so, as in tests/mtrain/parity.py, they must lie
    within K times this process's own float32 error plus FLOOR_ULPS ulps of the largest value (a wrong token or
    position moves a log-probability by far more: they differ by ~0.1 between tokens here)."""
    tokens = torch.tensor(ids)
    exact = torch.log_softmax(copy.deepcopy(model).double()(tokens[None])[0, :-1], -1).gather(-1, tokens[1:, None])
    exact = exact[:, 0]
    local = torch.tensor([e.logprob for e in prompt_logprobs(model, ids)], dtype=torch.float64)
    bound = K * (local - exact).abs().max() + FLOOR_ULPS * EPS32 * exact.abs().max()
    served = torch.tensor(served, dtype=torch.float64)
    assert served.shape == exact.shape and (served - exact).abs().max() <= bound


def continuation(tok, prompt, new):
    """The text new tokens add after the prompt, as a client reads it (the eos token left out)."""
    new = [t for t in new if t != EOS]
    return tok.decode(prompt + new)[len(tok.decode(prompt)):]


# -- Megatron-LM's PUT /api ------------------------------------------------------------------------------------

def test_megatron_api_generates_like_the_library(server, reference):
    model, tok, _ = reference
    prompts = ["t5 t37 t42 t8", "t9 t3"]
    status, answer = request(server.url + "/api", {"prompts": prompts, "tokens_to_generate": 8, "temperature": 0},
                             method="PUT")
    assert status == 200 and set(answer) == {"text", "segments", "logprobs"} and answer["logprobs"] is None
    ids = [tok.encode(p) for p in prompts]
    new = generate_batch(model, ids, max_new_tokens=8, sampling=Sampling(greedy=True), eos_ids=[EOS])
    assert answer["text"] == [tok.decode(p + n) for p, n in zip(ids, new)]
    assert answer["segments"] == [[tok.decode([t]) for t in p + n] for p, n in zip(ids, new)]
    sampled = [request(server.url + "/api", {"prompts": ["t5"], "tokens_to_generate": 6, "top_p": 0.9,
                                             "random_seed": s}, method="PUT")[1]["text"][0] for s in (1, 1, 2, 3)]
    assert sampled[0] == sampled[1] and len(set(sampled)) > 1  # the seed decides


@pytest.mark.parity
def test_megatron_api_takes_megatrons_fields_and_post(server, reference):
    """logprobs, add_BOS, no_log and the neutral values of Megatron's other fields are accepted (issue 28, item
    11); POST answers like PUT. The log-probabilities (prompt and continuation) are bounded by float32's own
    error (assert_within_float32_error)."""
    model, tok, _ = reference
    body = {"prompts": ["t5 t6"], "tokens_to_generate": 3, "temperature": 0, "logprobs": True, "add_BOS": True,
            "no_log": True, "top_p_decay": 0.0, "beam_width": None, "stop_on_eol": False}
    status, answer = request(server.url + "/api", body, method="POST")
    assert status == 200, answer
    ids = [1] + tok.encode("t5 t6")  # t1 is the test tokenizer's bos
    new = generate_batch(model, [ids], max_new_tokens=3, sampling=Sampling(greedy=True), eos_ids=[EOS])[0]
    assert answer["text"] == [tok.decode(ids + new)]
    assert_within_float32_error(answer["logprobs"][0], model, ids + new)
    status, answer = request(server.url + "/api", {"prompts": ["t5"], "beam_width": 2}, method="PUT")
    assert status == 400 and answer["error"].startswith('"beam_width" is not supported; this server takes only null')


@pytest.mark.parametrize("body, status, message", [
    (b"not json", 400, "the body is not JSON: Expecting value at line 1 column 1"),
    ([1], 400, "the body must be a JSON object"),
    ({"prompt": ["t5"]}, 400, "unknown field(s) \"prompt\" in the request; fields: "),
    ({"prompts": "t5"}, 400, '"prompts" must be a non-empty list of strings'),
    ({"prompts": ["t5"] * 5}, 400, '"prompts" has 5 entries; this server takes at most 4'),
    ({"prompts": ["t5"], "tokens_to_generate": -1}, 400, '"tokens_to_generate" must be an integer from 0 to 1024'),
    ({"prompts": ["t5"], "temperature": "hot"}, 400, '"temperature" must be a number from 0.0 to 100.0'),
    ({"prompts": ["t5"], "top_p": 1.5}, 400, '"top_p" must be a number from 0.0 to 1.0, got 1.5'),
    ({"prompts": ["t5 t6", "t7"], "tokens_to_generate": 300}, 400,
     "prompt 0: a prompt of 2 tokens plus 300 new tokens needs 302 positions; the model has 256"),
    ({"prompts": ["t5 " * 2000]}, 413, "the request body is larger than this server's limit of 4096 bytes"),
])
def test_megatron_api_bad_requests_get_clear_errors(server, body, status, message):
    got, answer = request(server.url + "/api", body, method="PUT")
    assert got == status and answer["error"].startswith(message), answer


def test_health_and_other_methods_and_paths(server):
    assert request(server.url + "/health", method="GET") == (200, {"status": "ok"})
    status, answer = request(server.url + "/api", method="GET")
    assert status == 405 and answer["error"].startswith("GET is not allowed on /api: use ")
    assert request(server.url + "/nope", {"prompts": ["t5"]})[0] == 404
    status, answer = request(server.url + "/v1/nope", {})
    assert status == 404 and set(answer["error"]) == {"message", "type", "param", "code"}


# -- OpenAI's /v1 ----------------------------------------------------------------------------------------------

def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="the model \"gpt-4\" does not exist"):
        client.models.retrieve("gpt-4")


def test_completion_plain_and_streamed_match_the_library(client, reference):
    """Greedy decoding is the same arithmetic whether served or called directly (one request, one batch), so
    the texts are equal; the streamed pieces join to the same text."""
    model, tok, greedy = reference
    ids = tok.encode("t5 t37 t42")
    new = greedy(ids, 12)
    answer = client.completions.create(model="tiny", prompt="t5 t37 t42", max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.text == continuation(tok, ids, new)
    assert choice.finish_reason == ("stop" if EOS in new else "length")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == \
        (3, len(new), 3 + len(new))
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(new)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                            n=2, logprobs=1))
    for index in (0, 1):  # each choice streams on its own, with the logprobs of its tokens
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == choice.text
        assert "".join(t for c in mine if c.logprobs for t in c.logprobs.tokens) == choice.text


def test_completion_sampling_seed_n_stop_and_logprobs(client, reference):
    model, tok, greedy = reference
    sample = dict(model="tiny", prompt="t5", max_tokens=6, temperature=0.9, top_p=0.95, n=2)
    first = client.completions.create(seed=7, **sample)
    again = client.completions.create(seed=7, **sample)
    other = client.completions.create(seed=8, **sample)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and texts == [c.text for c in again.choices]
    assert texts != [c.text for c in other.choices] or len(set(texts)) > 1  # the seed decides, choices differ
    # stop: cut before the stop string, which the greedy output holds at its third token
    ids = tok.encode("t9 t3")
    new = [t for t in greedy(ids, 8) if t != EOS]
    assert len(new) >= 4  # this model (seed 5) does not end early here
    stop = " " + tok.decode([new[2]])
    cut = client.completions.create(model="tiny", prompt="t9 t3", max_tokens=8, temperature=0, stop=[stop])
    full = continuation(tok, ids, new)
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    # logprobs: each chosen token's log-probability, and under greedy it is the largest of the top ones
    answer = client.completions.create(model="tiny", prompt="t9 t3", max_tokens=4, temperature=0, logprobs=3)
    lp = answer.choices[0].logprobs
    assert "".join(lp.tokens) == answer.choices[0].text == continuation(tok, ids, greedy(ids, 4))
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[chosen] == value == max(top.values()) and value < 0


@pytest.mark.parity
def test_completion_echo_scores_a_prompt(client, reference):
    """echo with max_tokens 0 and logprobs, as eval harnesses score a text's likelihood: the prompt comes back with
    the log-probability of each token after the first (bounded by float32's own error, see
    assert_within_float32_error); with max_tokens > 0 the completion follows the prompt."""
    model, tok, greedy = reference
    ids = tok.encode("t5 t37 t42 t8")
    answer = client.completions.create(model="tiny", prompt="t5 t37 t42 t8", max_tokens=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    assert choice.text == "t5 t37 t42 t8" and answer.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == ["t5", " t37", " t42", " t8"] and lp.text_offset == [0, 2, 6, 10]  # offsets into the text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert_within_float32_error(lp.token_logprobs[1:], model, ids)
    assert all(len(top) == 2 and max(top.values()) >= value for top, value in zip(lp.top_logprobs[1:],
                                                                                   lp.token_logprobs[1:]))
    answer = client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, temperature=0)
    assert answer.choices[0].text == tok.decode(ids) + continuation(tok, ids, greedy(ids, 3))


def test_chat_plain_and_streamed(client, reference):
    """The tokenizer's chat template formats the messages; the reply is the greedy continuation of that."""
    model, tok, greedy = reference
    messages = [{"role": "system", "content": "t7"}, {"role": "user", "content": "t8 t9"}]
    ids = tok.encode("t1 t4 t7 t4 t8 t9 t3", special=False)
    new = greedy(ids, 10)
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=2)
    message = answer.choices[0].message
    assert message.role == "assistant" and message.content == continuation(tok, ids, new)
    assert answer.usage.prompt_tokens == len(ids) and answer.object == "chat.completion"
    assert "".join(e.token for e in answer.choices[0].logprobs.content) == continuation(tok, ids, new)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


@pytest.mark.parametrize("call, param, message", [
    (dict(prompt="t5", temperature=3), "temperature", '"temperature" must be a number from 0.0 to 2.0, got 3'),
    (dict(prompt="t5", n=5), "n", '"n" must be an integer from 1 to 4, got 5'),
    (dict(prompt=["t5", "t6"], n=3), "n", "2 prompt(s) times n=3 make 6 sequences to generate; this server takes "
                                          "at most 4 per request"),
    (dict(prompt=["t5"] * 5), "prompt", "5 prompts make 5 sequences to generate; this server takes at most 4"),
    (dict(prompt="t5", max_tokens=300), "max_tokens", "prompt 0: a prompt of 1 tokens plus 300 new tokens needs"),
    (dict(prompt=[5, 300]), "prompt", "prompt holds token id 300, outside the model's vocabulary of 300"),
    (dict(prompt="t5", stop=["a", "b", "c", "d", "e"]), "stop", '"stop" must be a string or a list of at most 4'),
    (dict(prompt="t5", best_of=2), "best_of", '"best_of" is not supported; this server takes only null or 1'),
    (dict(prompt="t5", max_tokens=0), "max_tokens", '"max_tokens" must be an integer from 1 to 1024, got 0'),
    (dict(prompt="t5", extra_body={"best_of_all": 1}), "best_of_all", 'unknown field(s) "best_of_all"'),
])
def test_completion_bad_requests_get_openai_errors(client, call, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", **call)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["message"].startswith(message)
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


def test_chat_and_model_errors(client, server, checkpoint):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="t5")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="must be an object with a \"role\" among"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "t5"}])
    status, answer = request(server.url + "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and answer["error"]["message"].startswith("the body is not JSON")


def test_chat_without_a_template_is_refused(tmp_path):
    """A tokenizer without a chat template: a 400 saying so, naming the tokenizer (no model is run)."""
    from mtrain.serving import openai_api
    from mtrain.serving.service import Limits, Service

    hf = save_hf("llama", tmp_path / "hf", seed=5)
    tok = load_tokenizer(hf)
    service = Service(None, tok, None, frozenset(), Limits(), "m", None)
    with pytest.raises(BadRequest, match="has no chat template, so chat requests cannot be formatted") as caught:
        openai_api.chat_plan({"model": "m", "messages": [{"role": "user", "content": "t5"}]}, service)
    assert caught.value.param == "messages" and str(tok.path) in str(caught.value)


# -- the scheduler: batched when together, interleaved when not -------------------------------------------------

class GatedModel(torch.nn.Module):
    """The model, but each forward pass waits for the test to allow it (`allow(n)`, or `open()` for all)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config
        self.steps = threading.Semaphore(0)
        self.calls = 0

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.steps.release()

    def forward(self, *args, **kwargs):
        assert self.steps.acquire(timeout=120), "the test never allowed this step"
        self.calls += 1
        return self.inner(*args, **kwargs)


def _finish(job: Job) -> list[list[int]]:
    while True:
        kind, value = job.events.get(timeout=120)  # a scheduler that never answers fails, not hangs
        if kind == "done":
            return value
        assert kind != "error", value


def test_requests_that_arrive_together_run_as_one_batch(reference):
    model, _, greedy = reference
    gated = GatedModel(model)
    scheduler = Scheduler(gated)
    prompts = ([5, 6, 7], [8, 9, 10, 11])
    jobs = [scheduler.submit(Job([p], 5, Sampling(greedy=True), 0, frozenset({EOS}))) for p in prompts]
    scheduler.start()
    try:
        gated.allow(1000)
        outputs = [_finish(job) for job in jobs]
    finally:
        scheduler.stop()
    assert outputs == [[greedy([5, 6, 7], 5)], [greedy([8, 9, 10, 11], 5)]]
    # one batch: positions 3 … 8 (the shorter prompt's length to the longer's end), one forward pass each
    assert gated.calls == 6


def test_a_long_generation_does_not_hold_back_a_later_request(reference):
    """The later request joins at the next step and the two batches take turns, so it ends after a few steps of
    the long one, not after all of them; each gets the tokens it would get alone. The test allows the model's
    steps one by one, so no timing is involved."""
    model, _, greedy = reference
    gated = GatedModel(model)
    scheduler = Scheduler(gated).start()
    try:
        long = scheduler.submit(Job([[5, 6]], 200, Sampling(greedy=True), 0, frozenset({EOS})))
        gated.allow(1)
        assert long.events.get(timeout=120)[0] == "tokens"  # the long one is generating
        short = scheduler.submit(Job([[7, 8]], 3, Sampling(greedy=True), 0, frozenset({EOS})))
        # the short one needs 3 steps; the long one may take 1 step already under way, then one per turn: 7 steps
        # are enough for the short one to end only if the batches take turns (the long one has 199 to go)
        gated.allow(7)
        assert _finish(short) == [greedy([7, 8], 3)]
        gated.allow(1000)
        assert _finish(long) == [greedy([5, 6], 200)]
    finally:
        scheduler.stop()


def test_a_cancelled_request_stops_generating(reference):
    """A client that goes away (Job.cancel) ends its rows at the next step, and its batch then ends."""
    model, _, _ = reference
    gated = GatedModel(model)
    scheduler = Scheduler(gated).start()
    try:
        job = scheduler.submit(Job([[5, 6]], 200, Sampling(greedy=True), 0))
        gated.allow(1)
        assert job.events.get(timeout=120)[0] == "tokens"
        job.cancel()
        gated.allow(1000)
        (output,) = _finish(job)
        assert 1 <= len(output) <= 2  # the first token, and one more if its step had begun
    finally:
        scheduler.stop()


def test_requests_beyond_the_limit_are_refused_until_one_ends(reference):
    model, _, _ = reference
    gated = GatedModel(model)
    scheduler = Scheduler(gated, max_jobs=2).start()
    try:
        jobs = [scheduler.submit(Job([[5, 6]], 3, Sampling(greedy=True), 0)) for _ in range(2)]
        with pytest.raises(BadRequest, match=r"the server is busy: 2 requests are being served \(at most 2\)") as e:
            scheduler.submit(Job([[5, 6]], 3, Sampling(greedy=True), 0))
        assert e.value.status == 503
        gated.allow(1000)
        _finish(jobs[0])
        _finish(jobs[1])
        assert _finish(scheduler.submit(Job([[5, 6]], 3, Sampling(greedy=True), 0)))  # room again
    finally:
        scheduler.stop()


# -- stopping ----------------------------------------------------------------------------------------------------

def test_ctrl_c_stops_cleanly_during_a_streamed_request(checkpoint):
    """Ctrl-C (SIGINT) while a client streams: exit code 0, "stopped", no traceback and no "Aborted!"."""
    with running_server(checkpoint) as s:
        body = {"model": "tiny", "prompt": "t5", "max_tokens": 200, "stream": True}
        req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as response:
            assert response.readline().startswith(b"data: {")
            code, err = s.stop()
    assert code == 0 and err.rstrip().endswith("stopped"), err
    assert "Traceback" not in err and "Aborted!" not in err


def test_serve_refuses_a_missing_tokenizer(tmp_path):
    from click.testing import CliRunner

    from mtrain.cli import main

    hf = save_hf("llama", tmp_path / "hf", seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).unlink(missing_ok=True)
    result = CliRunner().invoke(main, ["serve", "--load", str(hf), "--port", "0"], catch_exceptions=False)
    assert result.exit_code == 1
    assert f"Error: {hf} carries no tokenizer files: pass --tokenizer DIR (prompts are text)" in result.output
