"""What the tests compare: IR tensors bit for bit, HF files bit for bit, and transformers' logits."""

from __future__ import annotations

from pathlib import Path

import torch


def ir_tensors(path: Path, **option_fields) -> dict[str, torch.Tensor]:
    """Every IR tensor of the checkpoint at `path` (format detected), materialized."""
    from mconvert import engine
    from mconvert.options import Options

    ir = engine.load(path, Options(**option_fields))
    return {name: t.load() for name, t in ir}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names in the same order, same dtypes, equal values."""
    assert list(a) == list(b), f"names differ: {set(a) ^ set(b)}"
    bad = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not bad, f"tensors differ: {bad[:10]}"


def assert_same_files(a: Path, b: Path) -> None:
    """Every tensor of the two HF directories' model.safetensors: same names, dtypes and bytes."""
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y), set(x) ^ set(y)
    bad = [k for k in x if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])]
    assert not bad, bad[:5]


def assert_same_hf_config(src: Path, out: Path) -> None:
    """transformers reads the same config from both, but where the source leaves a field to its default (null) and
    the output spells the value out (GPT-2's n_inner, Mixtral's head_dim, Mistral's attention_bias)."""
    import transformers

    want, got = (transformers.AutoConfig.from_pretrained(p).to_dict() for p in (src, out))
    differ = {k: (v, got.get(k)) for k, v in want.items() if v is not None and k != "_name_or_path" and got.get(k) != v}
    assert differ == {}


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of the HF model at `path` on `tokens`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


@torch.no_grad()
def hf_logits_with_mtp(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' logits of the model and of each MTP module (its own MtpModel, loaded from the checkpoint by its
    own weight conversions). Module i reads the main model's output (after the final norm) for positions 0..T-2-i
    and the tokens i+1 further on, as in speculative decoding; its logits there predict the token i+2 further on."""
    import transformers
    from transformers.modeling_layers import MtpModel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n, modules = model.config.num_hidden_layers, model.config.num_mtp_layers
    # MtpModel finds the MTP weights by these patterns (DeepSeek-V3's are for layer 61)
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n + i}.*" for i in range(modules)]
    mtp = MtpModel.from_pretrained(model).eval()
    out = model(tokens, output_hidden_states=True)
    hidden, logits = out.hidden_states[-1], []
    for i in range(modules):
        length = tokens.shape[1] - 1 - i
        positions = torch.arange(length)[None].expand(tokens.shape[0], -1)
        hidden = mtp.forward_layer(i, hidden[:, :length], positions, None, input_ids=tokens[:, i + 1:i + 1 + length])
        logits.append(mtp._project_to_logits(hidden))
    return out.logits, logits


def check_mtp_logits(model, hf_path: Path, tokens: torch.Tensor, atol: float) -> tuple[torch.Tensor, list]:
    """mtrain `model`'s logits and its MTP modules' logits (`mtp_logits`) equal transformers' of the HF checkpoint at
    `hf_path` within `atol`, every module of both; returns mtrain's (logits, MTP logits)."""
    with torch.no_grad():
        main, mtp = model.mtp_logits(tokens)
    want, want_mtp = hf_logits_with_mtp(hf_path, tokens)
    torch.testing.assert_close(main, want, atol=atol, rtol=0)
    assert len(mtp) == len(want_mtp), (len(mtp), len(want_mtp))
    for got, ref in zip(mtp, want_mtp):
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    return main, mtp
