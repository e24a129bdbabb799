"""End-to-end demo on a small built-in example: a random tiny Llama (GQA), converted to Megatron-core with
TP2 PP2, inspected, resharded to TP1 PP1, converted back to Hugging Face, and checked against the original
with `transformers` (bit-identical weights, identical logits).

    python examples/demo.py [WORKDIR]

Without WORKDIR it works in a temporary directory and removes it at the end; with one, the files stay there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers


def run(*args: str) -> None:
    print("$ " + " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    if len(sys.argv) > 1:
        work = Path(sys.argv[1])
        print(f"working in {work} (the files stay there)")
        sys.exit(demo(work))
    work = Path(tempfile.mkdtemp(prefix="mconvert-demo-"))
    print(f"working in {work} (removed at the end; `python examples/demo.py WORKDIR` keeps the files)")
    try:
        code = demo(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed {work}")
    sys.exit(code)


def demo(work: Path) -> int:
    """The demo's steps in `work`; 0 when the round trip gives identical logits."""
    hf = work / "hf"
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=352,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=850,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    print(f"built a random tiny Llama in {hf}")

    mconvert = str(Path(sys.executable).with_name("mconvert"))
    run(mconvert, "--loader", "llama_mistral", "--saver", "core", "--tp", "2", "--pp", "2",
        "--load-dir", str(hf), "--save-dir", str(work / "core_tp2pp2"), "--force")
    run(mconvert, "inspect", str(work / "core_tp2pp2"), "--no-tensors")
    run(mconvert, "--loader", "core", "--saver", "core", "--load-dir", str(work / "core_tp2pp2"),
        "--save-dir", str(work / "core_tp1pp1"), "--force")
    run(mconvert, "--loader", "core", "--saver", "llama_mistral", "--load-dir", str(work / "core_tp1pp1"),
        "--save-dir", str(work / "hf_back"), "--force")
    run(mconvert, "compare", str(hf), str(work / "hf_back"))

    tokens = torch.randint(0, 850, (1, 32), generator=torch.Generator().manual_seed(0))
    logits = [transformers.AutoModelForCausalLM.from_pretrained(p)(tokens).logits for p in (hf, work / "hf_back")]
    same = torch.equal(logits[0], logits[1])
    print(f"logits of the original and the round-tripped model are {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    main()
