"""Generation: the key/value cache gives the same logits and greedy tokens as recomputing the whole sequence, and
transformers' greedy generate (DeepSeek-V3's multi-latent attention too); batched prompts equal one-by-one
generation; contexts beyond the model's positions are refused; the `generate` command prints ids and text."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from mtrain.cli import main
from mtrain.errors import TrainError
from mtrain.generation import Sampling, generate, generate_batch
from mtrain.inference import load_model
from mtrain.models.kv_cache import KVCache
from tests.support.models import make_deepseek, make_hf, save_hf

# mistral: window 8, so it bites within these sequences; gpt2: learned positions; llama3: scaled rope, tied;
# qwen2: qkv biases, a layer exempt from the window; qwen3: q/k norms before rotary; gemma3_text: a window of 8 in
# layer 0 with its own rope theta, soft-capped logits
FAMILIES = ("llama", "llama3", "mistral", "gpt2", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for family in FAMILIES:
        hf = save_hf(family, root / family, seed=3)
        out[family] = (hf, load_model(hf)[0])
    return out


def assert_cached_pass_is_whole(model, tokens: torch.Tensor, prefill: int) -> KVCache:
    """Logits through the cache (`prefill` positions, then 3 at once: queries after cached keys need a mask, then
    one at a time) equal one whole pass; returns the filled cache."""
    batch, length = tokens.shape
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache(batch=batch, max_len=length)
        pieces = [model(tokens[:, :prefill], cache=cache), model(tokens[:, prefill:prefill + 3], cache=cache)]
        pieces += [model(tokens[:, i:i + 1], cache=cache) for i in range(prefill + 3, length)]
    # the same sums in other orders (attention over cached keys, other shapes): logits below 1, each float32 pass
    # within ~4e-7 of float64's (measured for transformers); 2e-5 (+ 1e-5 relative) leaves a factor > 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=2e-5, rtol=1e-5)
    return cache


@pytest.mark.parity
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_logits_equal_a_whole_pass(models, family):
    """Prefill 5 positions, then 3 at once (queries after cached keys need a mask), then one at a time."""
    tokens = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    cache = assert_cached_pass_is_whole(models[family][1], tokens, prefill=5)
    assert cache.length == 20


@pytest.mark.parity
@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_a_windowed_layer_keeps_only_its_window(models, family):
    """A sliding-window layer (window 8) keeps the last 7 positions between calls, with the same logits as a whole
    pass; Gemma's full-attention layer 1 keeps all 20."""
    tokens = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = assert_cached_pass_is_whole(models[family][1], tokens, prefill=10)
    kept = {i: layer.buffers[0].shape[2] for i, layer in cache.layers.items()}
    assert kept == ({0: 7, 1: 7} if family == "mistral" else {0: 7, 1: 20})


@pytest.mark.parity
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_the_cache_equals_without_and_transformers(models, family):
    model = models[family][1]
    prompt = [5, 17, 42, 8]
    cached = generate(model, prompt, max_new_tokens=40, greedy=True)
    assert cached == generate(model, prompt, max_new_tokens=40, greedy=True, use_cache=False)
    reference = make_hf(family, seed=3)
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                                  attention_mask=torch.ones(1, 4, dtype=torch.long), pad_token_id=0)[0, 4:].tolist()
    assert cached == want and len(want) == 40


def test_sampling_with_the_cache_equals_without(models):
    model = models["llama"][1]
    for sampling in (Sampling(top_k=5), Sampling(top_p=0.8, temperature=0.7)):
        with_cache = generate_batch(model, [[5, 6, 7]], max_new_tokens=20, sampling=sampling, seed=4)
        assert with_cache == generate_batch(model, [[5, 6, 7]], max_new_tokens=20, sampling=sampling, seed=4,
                                            use_cache=False)


def test_batched_prompts_equal_one_by_one(models):
    model = models["mistral"][1]
    prompts = [[5, 17, 42, 8], [9, 3], [100, 101, 102, 103, 104, 105, 106], [7]]
    batched = generate_batch(model, prompts, max_new_tokens=15, sampling=Sampling(greedy=True))
    assert batched == [generate(model, p, max_new_tokens=15, greedy=True) for p in prompts]
    # an end-of-sequence id stops its row only (and is kept); the others run on
    eos = batched[1][4]
    stopped = generate_batch(model, prompts, max_new_tokens=15, sampling=Sampling(greedy=True), eos_ids=[eos])
    for row, tokens in zip(batched, stopped):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert tokens == row[:cut]
    assert len(stopped[1]) == batched[1].index(eos) + 1 < len(batched[1])


def test_context_beyond_the_positions_is_refused(models):
    model = models["gpt2"][1]  # 128 learned positions
    with pytest.raises(TrainError) as e:
        generate(model, list(range(3, 103)), max_new_tokens=40, greedy=True)
    assert str(e.value) == ("a prompt of 100 tokens plus 40 new tokens needs 140 positions; the model has 128 "
                            "(max_position_embeddings): ask for at most 28 new tokens")
    assert len(generate(model, list(range(3, 103)), max_new_tokens=28, greedy=True)) == 28
    with pytest.raises(TrainError, match="outside the model's vocabulary of 300"):
        generate(model, [5, 300], max_new_tokens=1)


def mtrain(*args, ok=True) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert (result.exit_code == 0) == ok, result.output
    return result.output


def test_generate_command_prints_ids_and_text(models):
    from mtrain.data.tokenizer import load_tokenizer

    hf, model = models["llama"]
    tok = load_tokenizer(hf)  # words t0 … t298; t1 and t2 are bos and eos (so no prompt word starts with them)
    want = generate(model, [5, 37, 42, 8], max_new_tokens=6, greedy=True, eos_id=2)
    ids = [5, 37, 42, 8, *want]
    out = mtrain("generate", "--load", hf, "--tokens", "5 37 42 8", "--max-new-tokens", "6", "--greedy")
    assert out.splitlines() == [" ".join(map(str, ids)), tok.decode(ids)]
    assert tok.decode(ids).startswith("t5 t37 t42 t8 t")
    out = mtrain("generate", "--load", hf, "--prompt", "t5 t37 t42 t8", "--prompt", "t9 t3", "--max-new-tokens", "6",
                 "--greedy")
    second = generate(model, [9, 3], max_new_tokens=6, greedy=True, eos_id=2)
    assert out.splitlines() == [tok.decode(ids), "", tok.decode([9, 3, *second])]
    out = mtrain("generate", "--load", hf, "--tokens", "5 6", "--max-new-tokens", "255", ok=False)
    assert "Error: a prompt of 2 tokens plus 255 new tokens needs 257 positions; the model has 256" in out
    assert "--tokens" in mtrain("generate", "--load", hf, "--tokens", "5 x", ok=False)


def test_a_layer_cache_keeps_tensors_along_their_own_dims():
    """What a latent-attention layer would keep: (B, T, r) along dim 1 and (B, 1, T, d) along dim 2."""
    from mtrain.models.kv_cache import LayerCache

    cache = LayerCache(max_len=5)
    latent, rope_k = torch.randn(2, 5, 3), torch.randn(2, 1, 5, 4)
    a = cache.append(latent[:, :3], rope_k[:, :, :3], dim=(1, 2))
    b = cache.append(latent[:, 3:], rope_k[:, :, 3:], dim=(1, 2))
    assert [t.shape for t in a] == [(2, 3, 3), (2, 1, 3, 4)] and cache.length == 5
    assert torch.equal(b[0], latent) and torch.equal(b[1], rope_k)
    with pytest.raises(TrainError, match="the key/value cache holds 5 positions; 6 were asked for"):
        cache.append(latent[:, :1], rope_k[:, :, :1], dim=(1, 2))
    with pytest.raises(TrainError, match="one sequence dim per tensor and the same number of new positions"):
        LayerCache(max_len=5).append(latent[:, :2], rope_k[:, :, :3], dim=(1, 2))


# -- DeepSeek-V3: multi-latent attention caches its latent and rotary key -------------------------------------------

DEEPSEEK = {"query_lora_mtp1": dict(mtp=1), "no_query_lora": dict(q_lora_rank=None)}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    out = {}
    for name, overrides in DEEPSEEK.items():
        path = make_deepseek(tmp_path_factory.mktemp(name) / "hf", seed=11, **overrides)
        out[name] = (path, load_model(path)[0])
    return out


@pytest.mark.parity
@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_cached_logits_equal_a_whole_pass(deepseek, name):
    """Past YaRN's original 64 positions; each layer keeps kv_norm(latent) (B, T, 32) and the rotated shared key
    (B, 1, T, 8), not full keys and values; the MTP module's layer has no slot (generation does not run it)."""
    tokens = torch.randint(3, 300, (2, 80), generator=torch.Generator().manual_seed(2))
    cache = assert_cached_pass_is_whole(deepseek[name][1], tokens, prefill=30)
    assert sorted(cache.layers) == [0, 1, 2]
    assert all([tuple(t.shape) for t in layer.buffers] == [(2, 80, 32), (2, 1, 80, 8)]
               for layer in cache.layers.values())


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_greedy_with_the_cache_equals_without_and_transformers(deepseek, name):
    import transformers

    path, model = deepseek[name]
    prompt = [5, 17, 42, 8]
    cached = generate(model, prompt, max_new_tokens=70, greedy=True)
    assert cached == generate(model, prompt, max_new_tokens=70, greedy=True, use_cache=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=70, do_sample=False, eos_token_id=None,
                                  attention_mask=torch.ones(1, 4, dtype=torch.long), pad_token_id=0)[0, 4:].tolist()
    assert cached == want and len(want) == 70
