"""The `mtrain` command line.

    mtrain preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer TOKENIZER --append-eod
    mtrain pretrain --config run.yaml --train.lr 3e-4
    torchrun --nproc-per-node 2 -m mtrain pretrain --config run.yaml
    mtrain finetune --load HF_OR_MEGATRON_OR_MTRAIN_CHECKPOINT --config finetune.yaml
    mtrain evaluate --load CHECKPOINT --data data/corpus_text_document --seq-len 512
    mtrain generate --load CHECKPOINT --prompt "Once upon a time" --top-p 0.9
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import click

from mconvert.errors import ConvertError

EXTRA = {"ignore_unknown_options": True, "allow_extra_args": True}


class _Finite(click.ParamType):
    """A float >= 0 that is a number (click's FloatRange lets NaN through: every comparison with it is False)."""

    name = "number"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or number < 0:
            self.fail(f"{value!r} is not a finite number >= 0", param, ctx)
        return number


FINITE = _Finite()


def _fail_cleanly(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except ConvertError as e:  # TrainError too: a user error, shown without a traceback
            raise click.ClickException(str(e)) from None
        except OSError as e:  # a full disk, an unreadable file: one line too
            raise click.ClickException(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}") from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Pretrain and finetune transformer models built from the mconvert IR."""


@main.command()
@click.option("--input", "input_", required=True, type=click.Path(path_type=Path), help="JSON lines file.")
@click.option("--output-prefix", required=True, help="Writes {prefix}_{key}_document.bin/.idx.")
@click.option("--tokenizer", "--tokenizer-model", "tokenizer", required=True, type=click.Path(path_type=Path),
              help="tokenizer.json, a Hugging Face tokenizer directory, or a sentencepiece .model.")
@click.option("--json-key", "--json-keys", "json_keys", multiple=True, default=("text",), show_default=True,
              help="Field(s) to tokenize; one dataset per key.")
@click.option("--append-eod", is_flag=True, help="End every document with the tokenizer's eos token.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Tokenizer processes.")
@_fail_cleanly
def preprocess(input_, output_prefix, tokenizer, json_keys, append_eod, workers) -> None:
    """Tokenize JSON lines into Megatron indexed datasets (.bin/.idx)."""
    from mtrain.data.preprocess import PreprocessConfig
    from mtrain.data.preprocess import preprocess as run

    result = run(PreprocessConfig(input=input_, output_prefix=output_prefix, tokenizer=tokenizer,
                                  json_keys=tuple(json_keys), append_eod=append_eod, workers=workers))
    for key, prefix in result.prefixes.items():
        skipped = f", {result.skipped_empty[key]} empty skipped" if result.skipped_empty[key] else ""
        click.echo(f"{key}: {result.documents} documents, {result.tokens[key]:,} tokens -> {prefix}.bin/.idx{skipped}")


def _train(config_file: Path | None, overrides: list[str], finetune: Path | None = None,
           loader: str | None = None) -> None:
    from mtrain.config import load_config
    from mtrain.train import Trainer

    extra = []
    if finetune is not None:
        extra = ["--checkpoint.finetune", str(finetune)] + (["--checkpoint.loader", loader] if loader else [])
    config = load_config(config_file, overrides + extra)
    if finetune is not None and not config.checkpoint.finetune:
        raise ConvertError("finetune needs --load PATH")
    Trainer(config, out=lambda s: click.echo(s, err=True)).run()


@main.command(context_settings=EXTRA)
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML, TOML or JSON config file.")
@click.option("--finetune", type=click.Path(path_type=Path),
              help="Initial weights from any checkpoint mconvert reads (as `mtrain finetune --load`).")
@click.option("--loader", help="mconvert loader of --finetune (detected when omitted).")
@click.pass_context
@_fail_cleanly
def pretrain(ctx, config_file, finetune, loader) -> None:
    """Train a model from scratch (or resume the run in checkpoint.dir).

    Any config field can be set on the command line: --train.lr 3e-4 --data.seq_len 512.
    """
    _train(config_file, ctx.args, finetune=finetune, loader=loader)


@main.command(context_settings=EXTRA)
@click.option("--load", required=True, type=click.Path(path_type=Path),
              help="Initial weights: any checkpoint mconvert reads (HF, Megatron, mtrain).")
@click.option("--loader", help="mconvert loader of --load (detected when omitted).")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML, TOML or JSON config file.")
@click.pass_context
@_fail_cleanly
def finetune(ctx, load, loader, config_file) -> None:
    """Train from a checkpoint's weights: step 0, fresh optimizer, model config from the checkpoint."""
    _train(config_file, ctx.args, finetune=load, loader=loader)


@main.command()
@click.option("--load", required=True, type=click.Path(path_type=Path), help="Any checkpoint mconvert reads.")
@click.option("--loader", help="mconvert loader of --load (detected when omitted).")
@click.option("--data", "data", multiple=True, required=True, help="Dataset prefix (repeat for several).")
@click.option("--seq-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-samples", type=click.IntRange(min=1), help="Stop after this many windows.")
@_fail_cleanly
def evaluate(load, loader, data, seq_len, batch_size, max_samples) -> None:
    """Loss and perplexity of a checkpoint on datasets (consecutive windows, no shuffle)."""
    from mtrain.inference import evaluate as run
    from mtrain.inference import load_model

    model, _ = load_model(load, loader)
    r = run(model, list(data), seq_len=seq_len, batch_size=batch_size, max_samples=max_samples)
    click.echo(f"loss {r.loss:.4f} | perplexity {r.perplexity:.3f} | {r.samples} samples of {seq_len} tokens "
               f"({r.tokens:,} predicted tokens)")


@main.command()
@click.option("--load", required=True, type=click.Path(path_type=Path), help="Any checkpoint mconvert reads.")
@click.option("--loader", help="mconvert loader of --load (detected when omitted).")
@click.option("--tokenizer", type=click.Path(path_type=Path), help="Default: the checkpoint's tokenizer files.")
@click.option("--prompt", help="Text to continue.")
@click.option("--tokens", "token_ids", help="Token ids to continue instead of --prompt, e.g. '1 5 9'.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=32, show_default=True)
@click.option("--greedy", is_flag=True, help="Always take the most likely token.")
@click.option("--temperature", type=FINITE, default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1))
@click.option("--top-p", type=FINITE)
@click.option("--seed", type=int, default=0, show_default=True)
@_fail_cleanly
def generate(load, loader, tokenizer, prompt, token_ids, max_new_tokens, greedy, temperature, top_k, top_p,
             seed) -> None:
    """Continue a prompt with greedy, top-k or top-p sampling."""
    from mtrain.data.tokenizer import load_tokenizer
    from mtrain.inference import generate as run
    from mtrain.inference import load_model

    if (prompt is None) == (token_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --tokens IDS")
    model, ir = load_model(load, loader)
    tok = None
    if prompt is not None:
        source = tokenizer or _tokenizer_of(ir)
        if source is None:
            raise ConvertError(f"{load} carries no tokenizer files: pass --tokenizer, or --tokens IDS")
        tok = load_tokenizer(source)
    ids = tok.encode(prompt) if tok else [int(t) for t in token_ids.replace(",", " ").split()]
    eos = tok.eod_id if tok else None
    out = run(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
              greedy=greedy, seed=seed, eos_id=eos)
    click.echo(tok.decode(ids + out) if tok else " ".join(map(str, ids + out)))


def _tokenizer_of(ir) -> Path | None:
    from mtrain.data.tokenizer import checkpoint_tokenizer

    return checkpoint_tokenizer(ir.assets)


if __name__ == "__main__":
    main()
