"""The `mtrain` command line.

    mtrain preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer TOKENIZER --append-eod
    mtrain config                                  # every config section and field: type, default, meaning
    mtrain pretrain --config run.yaml --optim.lr 3e-4
    torchrun --nproc-per-node 2 -m mtrain pretrain --config run.yaml
    mtrain finetune --load HF_OR_MEGATRON_OR_MTRAIN_CHECKPOINT --config finetune.yaml
    mtrain evaluate --load CHECKPOINT --data data/corpus_text_document --seq-len 512
    mtrain generate --load CHECKPOINT --prompt "Once upon a time" --top-p 0.9
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time
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
@click.version_option(package_name="mconvert", prog_name="mtrain")
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
@click.option("--split-sentences", is_flag=True,
              help="One sequence per sentence, no special tokens (BERT's data: sentence pairs for NSP).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Tokenizer processes.")
@_fail_cleanly
def preprocess(input_, output_prefix, tokenizer, json_keys, append_eod, split_sentences, workers) -> None:
    """Tokenize JSON lines into Megatron indexed datasets (.bin/.idx)."""
    from mtrain.data.preprocess import PreprocessConfig
    from mtrain.data.preprocess import preprocess as run

    result = run(PreprocessConfig(input=input_, output_prefix=output_prefix, tokenizer=tokenizer,
                                  json_keys=tuple(json_keys), append_eod=append_eod,
                                  split_sentences=split_sentences, workers=workers),
                 progress=_preprocess_progress())
    for key, prefix in result.prefixes.items():
        skipped = f", {result.skipped_empty[key]} empty skipped" if result.skipped_empty[key] else ""
        click.echo(f"{key}: {result.documents} documents, {result.tokens[key]:,} tokens -> {prefix}.bin/.idx{skipped}")


def _preprocess_progress(every: float = 2.0):
    """A progress line on stderr at most every `every` seconds (documents, tokens, MB, MB/s), and a last one when
    there was one before (a short run prints only its summary)."""
    start = last = time.monotonic()
    shown = False

    def report(p) -> None:
        nonlocal last, shown
        now = time.monotonic()
        if (now - last < every and not p.done) or (p.done and not shown):
            return
        last, mb, shown = now, p.bytes_read / 1e6, True
        click.echo(f"preprocess: {p.documents:,} documents, {p.tokens:,} tokens, {mb:.1f}/{p.total_bytes / 1e6:.1f} "
                   f"MB ({100 * p.bytes_read // max(p.total_bytes, 1)}%), {mb / max(now - start, 1e-6):.1f} MB/s",
                   err=True)

    return report


def _train(config_file: Path | None, overrides: list[str], finetune: Path | None = None,
           loader: str | None = None) -> None:
    from mtrain.config import load_config
    from mtrain.stopping import graceful_stop
    from mtrain.train import Trainer

    extra = []
    if finetune is not None:
        extra = ["--checkpoint.finetune", str(finetune)] + (["--checkpoint.loader", loader] if loader else [])
    config = load_config(config_file, overrides + extra)
    if finetune is not None and not config.checkpoint.finetune:
        raise ConvertError("finetune needs --load PATH")
    main_rank = int(os.environ.get("RANK", "0")) == 0
    with graceful_stop(announce=main_rank) as stop:
        result = Trainer(config, out=lambda s: click.echo(s, err=True), stop=stop).run()
    if result.stopped_by:
        name = signal.Signals(result.stopped_by).name
        if result.checkpoints:
            line = (f"mtrain: stopped by {name} after step {result.step}: saved {result.checkpoints[-1]}; run the same "
                    "command to resume from it")
        else:
            line = f"mtrain: stopped by {name} after step {result.step}; nothing saved" + (
                " (checkpoint.dir is not set)" if not config.checkpoint.dir else " (no step was done)")
        if main_rank:
            click.echo(line, err=True)
        raise SystemExit(128 + result.stopped_by)  # the shell's convention for a death by that signal


@main.command(context_settings=EXTRA)
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="YAML, TOML or JSON config file.")
@click.option("--finetune", type=click.Path(path_type=Path),
              help="Initial weights from any checkpoint mconvert reads (as `mtrain finetune --load`).")
@click.option("--loader", help="mconvert loader of --finetune (detected when omitted).")
@click.pass_context
@_fail_cleanly
def pretrain(ctx, config_file, finetune, loader) -> None:
    """Train a model from scratch (or resume the run in checkpoint.dir).

    Any config field can be set on the command line: --optim.lr 3e-4 --data.seq_len 512 (lists: a,b or [a, b];
    null for none). `mtrain config` lists every section and field with its type, default and meaning.
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
    """Train from a checkpoint's weights: step 0, fresh optimizer, model config from the checkpoint.

    Any config field can be set on the command line: --optim.lr 2e-5 --data.seq_len 2048 (lists: a,b or [a, b];
    null for none); `mtrain config` lists them all. --model.FIELD changes the checkpoint's config where a finetune
    may (moe_aux_loss_coeff, moe_jitter_eps, max_position_embeddings, rope_theta, rope_scaling, sliding_window,
    full_attention_layers, bos/eos/pad_token_id, dtype); shape fields are refused. The tokenizer is data.tokenizer, else
    the checkpoint's; it is copied into every checkpoint (for generate, serve, evaluate and export).
    """
    _train(config_file, ctx.args, finetune=load, loader=loader)


@main.command("config", context_settings=EXTRA)
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="Show this file's resolved values.")
@click.pass_context
@_fail_cleanly
def config_(ctx, config_file) -> None:
    """Every config section and field with its type, default and meaning, as YAML.

    With --config FILE (and --section.field overrides) the values shown are that run's.
    """
    from mtrain.config import load_config
    from mtrain.config_doc import reference

    resolved = load_config(config_file, ctx.args) if config_file or ctx.args else None
    click.echo(reference(resolved), nl=False)


LOAD = click.option("--load", required=True, type=click.Path(path_type=Path),
                    help="Any checkpoint mconvert reads (HF, Megatron, an mtrain run or step).")
LOADER = click.option("--loader", help="mconvert loader of --load (detected when omitted).")
TOKENIZER = click.option("--tokenizer", type=click.Path(path_type=Path),
                         help="Default: the checkpoint's tokenizer files.")


def _progress(label: str):
    """A progress line on stderr about every tenth of the work (and at the end)."""
    shown = [-1]

    def report(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth != shown[0] or done == total:
            shown[0] = tenth
            click.echo(f"{label}: {done}/{total} ({100 * done // max(total, 1)}%)", err=True)

    return report


@main.command()
@LOAD
@LOADER
@click.option("--data", "data", multiple=True, help="Dataset prefix (repeat for several).")
@click.option("--split", type=click.Choice(["train", "valid", "test", "all"]), default="all", show_default=True,
              help="Which documents of each dataset.")
@click.option("--split-weights", help="train,valid,test shares (as data.split). Default: the run's data.split "
              "for an mtrain checkpoint; other checkpoints need it with --split train/valid/test.")
@click.option("--seq-len", type=click.IntRange(min=1), help="Default: the run's data.seq_len for an mtrain "
              "checkpoint, else data.seq_len's default (1024) or the model's max_position_embeddings if fewer.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-samples", type=click.IntRange(min=1), help="Stop after this many windows (or passages).")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Stop after about this many predicted tokens.")
@click.option("--lambada", type=click.Path(path_type=Path),
              help="Instead of --data: last-word accuracy on this JSON-lines file of {\"text\": ...} passages.")
@TOKENIZER
@_fail_cleanly
def evaluate(load, loader, data, split, split_weights, seq_len, batch_size, max_samples, max_tokens, lambada,
             tokenizer) -> None:
    """Loss and perplexity on datasets (consecutive windows, no shuffle), or zero-shot last-word accuracy.

    \b
    LAMBADA-style scoring (--lambada): each passage's last word is predicted from the text before it; a passage
    counts when the greedy prediction of every token of that word is right (see mtrain/tasks.py).
    """
    from mtrain import inference
    from mtrain.config import DataConfig

    if bool(data) == bool(lambada):
        raise click.UsageError("give --data PREFIX (loss and perplexity) or --lambada FILE (last-word accuracy)")
    ir = inference.load_ir(load, loader)
    if lambada:
        from mtrain.tasks import last_word_accuracy, read_passages

        tok = inference.load_tokenizer_for(ir, tokenizer, needed_for="the task file is text")
        model = inference.model_of(ir, needs_decoder="last-word accuracy (--lambada)")
        passages = read_passages(lambada, tok, max_samples=max_samples,
                                 max_positions=model.config.max_position_embeddings)
        r = last_word_accuracy(model, passages, batch_size=batch_size, progress=_progress("passages"))
        click.echo(f"last-word accuracy {r.accuracy:.4f} ({r.correct}/{r.total} passages of {lambada})")
        return
    run = inference.run_config(ir).get("data") or {}
    if split != "all" and not (split_weights or run.get("split")):
        raise click.UsageError(f"--split {split}: {load} does not record the split of the run that trained it; give "
                               "--split-weights (that run's data.split, e.g. 969,30,1) or --split all")
    model = inference.model_of(ir)
    if model.config.is_bert:
        _evaluate_bert(model, ir, run, list(data), split, split_weights, seq_len, batch_size, max_samples, tokenizer)
        return
    if seq_len is None:
        seq_len = run.get("seq_len") or min(DataConfig().seq_len, model.config.max_position_embeddings)
        origin = "from the run" if run.get("seq_len") else "data.seq_len's default, at most the model's positions"
        click.echo(f"sequence length {seq_len} ({origin}; --seq-len to change)", err=True)
    r = inference.evaluate(model, list(data), seq_len=seq_len, batch_size=batch_size, split=split,
                           split_weights=split_weights or run.get("split") or "969,30,1", max_samples=max_samples,
                           max_tokens=max_tokens, progress=_progress("windows"))
    click.echo(f"loss {r.loss:.4f} | perplexity {r.perplexity:.3f} | {r.samples} samples of {seq_len} tokens "
               f"({r.tokens:,} predicted tokens, split {split})")


def _evaluate_bert(model, ir, run, data, split, split_weights, seq_len, batch_size, max_samples, tokenizer) -> None:
    """`evaluate --data` of a BERT: MLM loss (and NSP loss and accuracy) on masked samples, masked as the run that
    trained it (its mlm section: special ids, masking probability) or with the tokenizer's special tokens."""
    from mtrain import inference
    from mtrain.config import DataConfig, MLMConfig, build_section
    from mtrain.data.loader import masking_config

    seq_len = seq_len or run.get("seq_len") or min(128, model.config.max_position_embeddings)
    mlm = build_section(MLMConfig, "mlm", (inference.run_config(ir).get("mlm") or {}))
    source = tokenizer or inference.checkpoint_tokenizer(ir.assets)
    masking = masking_config(DataConfig(seq_len=seq_len, seed=run.get("seed", DataConfig().seed)), mlm,
                             model.config.vocab_size, str(source) if source else None, model.config.binary_head)
    r = inference.evaluate_bert(model, data, masking, batch_size=batch_size, split=split,
                                split_weights=split_weights or run.get("split") or "969,30,1",
                                max_samples=max_samples, progress=_progress("samples"))
    nsp = f" | nsp loss {r.nsp_loss:.4f} | nsp accuracy {r.nsp_accuracy:.4f}" if r.nsp_loss is not None else ""
    click.echo(f"mlm loss {r.mlm_loss:.4f}{nsp} | {r.samples} samples of at most {seq_len} tokens "
               f"({r.predicted_tokens:,} predicted tokens, split {split})")


def _sampling(greedy, temperature, top_k, top_p):
    from mtrain.generation import Sampling

    return Sampling(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)


@main.command()
@LOAD
@LOADER
@TOKENIZER
@click.option("--prompt", "prompts", multiple=True, help="Text to continue (repeat for a batch of prompts).")
@click.option("--tokens", "token_ids", multiple=True,
              help="Token ids to continue instead of --prompt, e.g. '1 5 9' (repeat for a batch).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=32, show_default=True)
@click.option("--greedy", is_flag=True, help="Always take the most likely token.")
@click.option("--temperature", type=FINITE, default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1))
@click.option("--top-p", type=FINITE)
@click.option("--seed", type=int, default=0, show_default=True)
@_fail_cleanly
def generate(load, loader, tokenizer, prompts, token_ids, max_new_tokens, greedy, temperature, top_k, top_p,
             seed) -> None:
    """Continue prompts with greedy, top-k or top-p sampling (a batch when several are given).

    Prints the text of each prompt and its continuation; with --tokens the ids first, then the text when a
    tokenizer is at hand. Prompt plus new tokens must fit the model's positions.
    """
    from mtrain import inference
    from mtrain.generation import eos_ids_of, generate_batch

    if bool(prompts) == bool(token_ids):
        raise click.UsageError("give --prompt TEXT or --tokens IDS (either may be repeated), not both")
    ir = inference.load_ir(load, loader)  # the tokenizer is checked before any weight is read
    tok = inference.load_tokenizer_for(ir, tokenizer, needed_for="or give --tokens IDS" if prompts else None)
    model = inference.model_of(ir, needs_decoder="generate")
    if prompts:
        ids = [tok.encode(p) for p in prompts]
    else:
        ids = [_token_ids(t) for t in token_ids]
    new = generate_batch(model, ids, max_new_tokens=max_new_tokens, sampling=_sampling(greedy, temperature, top_k,
                                                                                       top_p),
                         seed=seed, eos_ids=eos_ids_of(model.config, tok.eod_id if tok else None))
    for i, (p, n) in enumerate(zip(ids, new)):
        if i:
            click.echo("")
        if token_ids:
            click.echo(" ".join(map(str, p + n)))
        if tok is not None:
            click.echo(tok.decode(p + n))


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of token ids such as '1 5 9'", param_hint="--tokens") \
            from None


@main.command()
@LOAD
@LOADER
@TOKENIZER
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=5000, show_default=True, help="0: any free port.")
@click.option("--max-prompts", type=click.IntRange(min=1), default=32, show_default=True,
              help="Sequences per request: prompts (times n for OpenAI requests).")
@click.option("--max-tokens-to-generate", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--max-request-bytes", type=click.IntRange(min=64), default=1 << 20, show_default=True)
@click.option("--model-name", help="The model id of the OpenAI endpoints (default: the --load directory's name).")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests waiting or generating at once; more get 503.")
@_fail_cleanly
def serve(load, loader, tokenizer, host, port, max_prompts, max_tokens_to_generate, max_request_bytes,
          model_name, max_concurrent_requests) -> None:
    """Serve text generation over HTTP (needs Flask: pip install 'mconvert[serve]').

    \b
    PUT /api {"prompts": ["Once upon a time"], "tokens_to_generate": 32, "temperature": 0.8, "top_k": 0,
              "top_p": 0.9}  ->  {"text": ["Once upon a time ..."], ...}      (Megatron-LM's server)
    POST /v1/completions, POST /v1/chat/completions, GET /v1/models          (OpenAI's protocol)
    GET /health
    """
    from mtrain import inference
    from mtrain.generation import eos_ids_of
    from mtrain.serving.chat_template import find_chat_template
    from mtrain.serving.http import check_installed, create_app
    from mtrain.serving.http import serve as run
    from mtrain.serving.scheduler import Scheduler
    from mtrain.serving.service import Limits, Service

    limits = Limits(max_prompts=max_prompts, max_tokens_to_generate=max_tokens_to_generate,
                    max_request_bytes=max_request_bytes)
    check_installed()
    try:  # Ctrl-C while loading stops as quietly as Ctrl-C while serving (no "Aborted!")
        ir = inference.load_ir(load, loader)
        tok = inference.load_tokenizer_for(ir, tokenizer, needed_for="prompts are text")  # before any weight
        model = inference.model_of(ir, needs_decoder="serve")
    except KeyboardInterrupt:
        click.echo("stopped", err=True)
        return
    try:
        template = find_chat_template(tok)
    except ConvertError as e:
        click.echo(f"warning: {e}; chat requests will be refused", err=True)
        template = None
    name = model_name or Path(load).resolve().name
    scheduler = Scheduler(model, max_jobs=max_concurrent_requests).start()
    service = Service(model, tok, scheduler, frozenset(eos_ids_of(model.config, tok.eod_id)), limits, name,
                      template)
    try:
        run(create_app(service), host, port, lambda url: click.echo(
            f"serving {load} as model {name!r} at {url}/api (PUT) and {url}/v1 (OpenAI); Ctrl-C stops", err=True))
    finally:
        scheduler.stop()
    click.echo("stopped", err=True)


if __name__ == "__main__":
    main()
