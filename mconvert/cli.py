"""The `mconvert` command line.

    mconvert --loader llama_mistral --saver core --tp 4 --pp 2 --load-dir HF_DIR --save-dir OUT
    mconvert inspect PATH
    mconvert compare A B
    mconvert verify A B
    mconvert plugins
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import json
import re
import warnings
from pathlib import Path

import click
from click.core import ParameterSource

from mconvert import registry
from mconvert.errors import ConvertError
from mconvert.staging import Interrupted

# Everything that needs torch is imported where it is used: `mconvert --help` must not pay for it.

POSITIVE = click.IntRange(min=1)
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
# Options that only some loaders/savers understand; giving one to a plugin that ignores it is an error.
PLUGIN_OPTIONS = ("tp", "pp", "vpp", "ep", "etp", "first_stage_layers", "last_stage_layers", "transformer_impl",
                  "expert_layout", "ckpt_format", "make_vocab_size_divisible_by", "iteration", "true_vocab_size",
                  "max_shard_size", "fp8_weights", "mtp_layer_name", "training_state", "optimizer_sharding",
                  "integrity_manifest", "verify_integrity")


def parse_size(text: str) -> int:
    """`5GB`, `500MiB`, `1000000` -> bytes (GB = 10^9, GiB = 2^30, as Hugging Face counts)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size such as 5GB or 500MiB")
    unit = m.group(2).rstrip("b")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def _fail_cleanly(func):
    """One `Error:` line and a non-zero exit for bad input, an OS error, or an interruption (SIGINT: 130,
    SIGTERM: 143, as a shell reports them); never a traceback."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except ConvertError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            raise click.ClickException(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}") from None
        except (KeyboardInterrupt, Interrupted) as e:
            name = e.name if isinstance(e, Interrupted) else "SIGINT"
            if isinstance(e, Interrupted) and e.complete is not None:
                click.echo(f"Error: interrupted by {name} just after the output was complete: {e.complete} is in "
                           "place, whole", err=True)
            else:
                click.echo(f"Error: interrupted by {name}; no output was left behind", err=True)
            raise SystemExit(128 + (e.signum if isinstance(e, Interrupted) else 2)) from None

    return wrapper


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"],
                                                            "max_content_width": 110})
@click.version_option(package_name="mconvert", prog_name="mconvert")
@click.option("--loader", help="Source format (see `mconvert plugins`); detected from the files when omitted.")
@click.option("--saver", help="Target format: llama_mistral, core, ... (see `mconvert plugins`).")
@click.option("--load-dir", type=click.Path(path_type=Path), help="Source checkpoint directory (or a hub id in "
              "the local Hugging Face cache).")
@click.option("--save-dir", type=click.Path(path_type=Path), help="Output directory; written atomically.")
@click.option("--tp", "--target-tensor-parallel-size", "tp", type=POSITIVE, default=1, show_default=True,
              help="Tensor-parallel size of the output.")
@click.option("--pp", "--target-pipeline-parallel-size", "pp", type=POSITIVE, default=1, show_default=True,
              help="Pipeline-parallel size of the output.")
@click.option("--vpp", type=POSITIVE, default=1, show_default=True,
              help="Virtual pipeline chunks per stage (interleaved schedule).")
@click.option("--ep", "--target-expert-parallel-size", "ep", type=POSITIVE, default=1, show_default=True,
              help="Expert-parallel size of the output (MoE models).")
@click.option("--etp", "--target-expert-tensor-parallel-size", "--expert-tensor-parallel-size", "etp", type=POSITIVE,
              help="Expert tensor-parallel size of the output (MoE models; must divide --tp). Default: --tp.")
@click.option("--first-stage-layers", "--decoder-first-pipeline-num-layers", "first_stage_layers", type=POSITIVE,
              help="Layers on the first pipeline stage (uneven split).")
@click.option("--last-stage-layers", "--decoder-last-pipeline-num-layers", "last_stage_layers", type=POSITIVE,
              help="Layers on the last pipeline stage (uneven split).")
@click.option("--transformer-impl", "--saver-transformer-impl", "transformer_impl",
              type=click.Choice(["local", "te", "transformer_engine"]), default="local", show_default=True,
              help="Megatron key names: local modules or Transformer Engine's fused names.")
@click.option("--expert-layout", type=click.Choice(["sequential", "grouped", "legacy_grouped", "single_grouped"]),
              help="How Megatron stores MoE experts: sequential (local_experts.{j}, default), grouped (Transformer "
              "Engine grouped GEMM, linear_fc1.weight{j}; needs --transformer-impl te), legacy_grouped "
              "(GroupedMLP weight1/weight2 of older Megatron-LM) or single_grouped (TE grouped GEMM with one "
              "[experts, out, in] linear_fc1.weight; needs --transformer-impl te).")
@click.option("--moe-grouped-gemm", is_flag=True, help="Same as --expert-layout grouped (Megatron's flag).")
@click.option("--moe-single-grouped-weight", is_flag=True,
              help="Same as --expert-layout single_grouped (Megatron's flag; with or without --moe-grouped-gemm).")
@click.option("--ckpt-format", type=click.Choice(["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"]),
              default="torch",
              show_default=True, help="Megatron checkpoint format written by the core saver.")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), help="Cast all weights (default: keep the source's).")
@click.option("--bf16", "bf16", is_flag=True, help="Same as --dtype bf16.")
@click.option("--fp16", "fp16", is_flag=True, help="Same as --dtype fp16.")
@click.option("--make-vocab-size-divisible-by", type=POSITIVE,
              help="Pad the vocabulary to a multiple of this times TP, as Megatron-LM does (128: its default "
              "table). Default: a Megatron source's own divisor; else no padding, unless the vocabulary is not a "
              "multiple of TP (the note says which value Megatron-LM resumes with).")
@click.option("--true-vocab-size", type=POSITIVE,
              help="Real vocabulary size of a padded (Megatron) source.")
@click.option("--tokenizer", "--tokenizer-model", "tokenizer", type=click.Path(exists=True, path_type=Path),
              help="Directory with tokenizer files to put beside the output.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard (HF savers).")
@click.option("--iteration", type=click.IntRange(min=0),
              help="Iteration number to write (Megatron savers); default: the source's, "
              "else 1.")
@click.option("--model-type", type=click.Choice(["GPT"]), default="GPT", hidden=True,
              help="Accepted for Megatron compatibility; only GPT models exist here.")
@click.option("--workers", type=POSITIVE, help="Output files (or parts of one) written at once. Default: one per CPU, "
              "up to 8. Under torchrun, per rank: each rank writes its share of the files.")
@click.option("--fp8-weights", is_flag=True, help="Write the linear weights of the layers FP8 (e4m3) with 128x128 "
              "block scales (weight_scale_inv), as DeepSeek-V3 ships them (saver deepseek_hf).")
@click.option("--skip-mtp", is_flag=True, help="Leave out multi-token-prediction modules (DeepSeek-V3's MTP "
              "layers); without it they are converted, or the conversion fails if the target cannot hold them.")
@click.option("--mtp-layer-name", type=click.Choice(["transformer_layer", "mtp_model_layer"]),
              default="transformer_layer", show_default=True,
              help="Saver core, --ckpt-format torch: the key of an MTP module's layer (mtp.layers.M.NAME.*). "
              "megatron-core 0.16 names it transformer_layer, 0.19 mtp_model_layer (its torch_dist "
              "checkpoints keep transformer_layer, which this saver always writes there). Both are read.")
@click.option("--merge-adapter", type=click.Path(path_type=Path), help="A PEFT LoRA adapter directory "
              "(adapter_config.json + adapter_model.safetensors) merged into the model on the way: W + scale * B A in "
              "float32, cast to W's dtype. Refused unless it fits the source model.")
@click.option("--training-state", is_flag=True,
              help="Carry the training state too: fp32 master weights, Adam's moments, step, param groups, LR "
              "schedule, iteration, consumed samples (and RNG when the layout is unchanged). Core torch, torch_dist.")
@click.option("--optimizer-sharding", type=click.Choice(["plain", "fully_reshardable", "fully_sharded_model_space",
                                                       "dp_reshardable", "dp_zero_gather_scatter"]),
              help="Saver core, --training-state: write the plain optimizer or the distributed optimizer in this "
              "sharding type (default: as the source; fully_reshardable for dp_reshardable and dp_zero_gather_scatter, "
              "which are read, not written). With --ckpt-format torch any distributed type means distrib_optim.pt.")
@click.option("--integrity-manifest/--no-integrity-manifest", default=True, show_default=True,
              help="Saver core, --ckpt-format torch_dist: write integrity.json, the SHA-256 of every file, as "
              "megatron-core does when saving with --verify-integrity. --no-integrity-manifest skips all hashing "
              "(SHA-256 costs about twice cp's CPU per byte). What is lost: a corrupt or changed file is no longer "
              "detected when the checkpoint is read (by mconvert or Megatron), and a Megatron run given "
              "--verify-integrity refuses to load the output (it finds no integrity.json to check).")
@click.option("--verify-integrity/--no-verify-integrity", default=True, show_default=True,
              help="Loader core, a torch_dist source with integrity.json: check every file against its SHA-256 "
              "before any of its bytes are used (what megatron-core does only when loading with "
              "--verify-integrity). --no-verify-integrity reads without hashing (SHA-256 costs about twice cp's "
              "CPU per byte); a corrupt or changed file is then converted as it is.")
@click.option("--force", is_flag=True, help="Replace an existing, non-empty --save-dir.")
@click.option("--verify", "verify_output", is_flag=True,
              help="Before moving the output into place, run it and the source on the same tokens (as `mconvert "
              "verify` does); if they differ, nothing is written and the exit status is 1.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors (no progress, notes or summary).")
@click.pass_context
@_fail_cleanly
def main(ctx: click.Context, loader, saver, load_dir, save_dir, force, verify_output, quiet, **opts) -> None:
    """Convert and reshard Megatron and Hugging Face checkpoints.

    \b
    Examples:
      mconvert --loader llama_mistral --saver core --tp 4 --pp 2 --load-dir HF --save-dir MEGATRON
      mconvert --loader core --saver core --tp 1 --pp 1 --load-dir MEGATRON --save-dir MERGED
      mconvert --saver llama_mistral --load-dir MEGATRON --save-dir HF_OUT
      mconvert inspect MEGATRON

    The source format is detected when --loader is omitted. Output goes to a temporary directory beside
    --save-dir and is moved into place only when complete.
    """
    if ctx.invoked_subcommand is not None:
        return
    if not (saver and load_dir and save_dir):
        if not (saver or load_dir or save_dir):
            click.echo(ctx.get_help())
            return
        missing = [n for n, v in (("--saver", saver), ("--load-dir", load_dir), ("--save-dir", save_dir)) if not v]
        raise click.UsageError(f"a conversion needs {', '.join(missing)}")
    with _long_lived_imports():
        from mconvert import engine, workers
        from mconvert.options import LAYOUT_OPTIONS
        from mconvert.progress import Progress, human_bytes

        source = engine.resolve_loader(loader, load_dir)
        target = registry.get_saver(saver)
    _check_applicable(ctx, source, target)
    options = _options(opts)
    grouped = workers.init_from_env()  # under torchrun: every rank writes its share
    leader = workers.team().leader
    try:
        progress = Progress(enabled=not quiet)
        check = _verify_output(load_dir, source.name, save_dir, options, progress) if verify_output else None
        with warnings.catch_warnings():
            if quiet:  # -q: nothing at all on success; errors still say what went wrong
                warnings.simplefilter("ignore")
            summary = engine.convert(load_dir, save_dir, loader=source.name, saver=target.name, options=options,
                                     force=force, progress=progress, check=check)
    finally:
        gc.unfreeze()
        if grouped:
            workers.end_process_group()
    if quiet or not leader:  # rank 0 reports
        return
    ir = summary.ir
    for note in ir.source.notes:
        click.echo(f"note: {note}", err=True)
    rate = summary.bytes_written / max(summary.seconds, 1e-9)
    click.echo(
        f"converted {load_dir} ({source.name}: {ir.config.family}, {ir.config.num_layers} layers, "
        f"{ir.num_params:,} parameters) -> {save_dir} ({target.name}"
        f"{', ' + options.layout.describe() if target.options & set(LAYOUT_OPTIONS) else ''}): "
        f"{summary.files} files, {human_bytes(summary.bytes_written)} in {summary.seconds:.2f} s "
        f"({human_bytes(rate)}/s)",
        err=True,
    )


@contextlib.contextmanager
def _long_lived_imports():
    """Importing torch and the plugins makes about half a million objects that live as long as the process: no
    garbage collection while they are made, and none scanning them afterwards (gc.freeze; about a tenth of the
    CPU time of a conversion otherwise goes to collections). Nor at the end: the interpreter's last collection
    would scan every object alive (0.3-0.4 s of CPU with torch imported) only to free memory the process is about
    to give back, so whatever is alive at exit is frozen first (at exit: an in-process caller, which unfreezes
    after each command, goes on collecting until then)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
        atexit.unregister(gc.freeze)  # registered once however many commands run in this process
        atexit.register(gc.freeze)


def _verify_output(load_dir: Path, loader: str, save_dir: Path, options, progress):
    """`--verify`: a check of the staged output against the source (read again, without the --dtype cast)."""

    def check(staging: Path) -> None:
        from mconvert.tools.verify import VerifySettings, verify
        from mconvert.tools.verify.report import summary_line

        settings = VerifySettings(loader_a=loader, options=dataclasses.replace(options, dtype=None))
        report = verify(load_dir, staging, settings, progress, labels=(str(load_dir), str(save_dir)))
        if progress.enabled:  # -q leaves it out
            click.echo(f"verify: {summary_line(report)}", err=True)
        if not report.passed:
            raise ConvertError(f"the output does not verify against {load_dir}; nothing was written to {save_dir}")

    return check


def _check_applicable(ctx: click.Context, loader: registry.Plugin, saver: registry.Plugin) -> None:
    given = [n for n in PLUGIN_OPTIONS if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
    flags = ("moe_grouped_gemm", "moe_single_grouped_weight")
    if any(ctx.get_parameter_source(f) == ParameterSource.COMMANDLINE for f in flags) and "expert_layout" not in given:
        given.append("expert_layout")  # --moe-grouped-gemm and --moe-single-grouped-weight set the expert layout
    understood = loader.options | saver.options
    ignored = [n for n in given if n not in understood]
    if ignored:
        flags = ", ".join(_flag_given(ctx, n) for n in ignored)
        raise ConvertError(f"{flags} does not apply to loader {loader.name} / saver {saver.name}")


def _flag_given(ctx: click.Context, name: str) -> str:
    """The option as the user spelled it: `--no-integrity-manifest` for the off side of an on/off pair."""
    param = next(p for p in ctx.command.params if p.name == name)
    if isinstance(param, click.Option) and param.secondary_opts and ctx.params.get(name) is False:
        return param.secondary_opts[0]
    return "--" + name.replace("_", "-")


def _options(o: dict):
    from mconvert.options import Options
    from mconvert.rules.layout import ParallelLayout

    layout = ParallelLayout(tp=o["tp"], pp=o["pp"], vpp=o["vpp"], ep=o["ep"], etp=o["etp"],
                            first_stage_layers=o["first_stage_layers"], last_stage_layers=o["last_stage_layers"])
    return Options(
        layout=layout,
        transformer_impl="te" if o["transformer_impl"] in ("te", "transformer_engine") else "local",
        expert_layout=_expert_layout(o),
        ckpt_format=o["ckpt_format"],
        dtype=_dtype(o),
        make_vocab_size_divisible_by=o["make_vocab_size_divisible_by"],
        true_vocab_size=o["true_vocab_size"],
        tokenizer=o["tokenizer"],
        max_shard_size=parse_size(o["max_shard_size"]),
        iteration=o["iteration"],
        workers=o["workers"],
        skip_mtp=o["skip_mtp"],
        mtp_layer_name=o["mtp_layer_name"],
        fp8_weights=o["fp8_weights"],
        merge_adapter=o["merge_adapter"],
        training_state=o["training_state"],
        optimizer_sharding=o["optimizer_sharding"],
        integrity_manifest=o["integrity_manifest"],
        verify_integrity=o["verify_integrity"],
    )


def _expert_layout(o: dict) -> str:
    """--moe-grouped-gemm is --expert-layout grouped, and with --moe-single-grouped-weight (as Megatron pairs them)
    single_grouped; naming another layout beside them is a contradiction."""
    flag = "single_grouped" if o["moe_single_grouped_weight"] else "grouped" if o["moe_grouped_gemm"] else None
    if flag and o["expert_layout"] not in (None, flag):
        given = "--moe-single-grouped-weight" if flag == "single_grouped" else "--moe-grouped-gemm"
        raise ConvertError(f"{given} and --expert-layout {o['expert_layout']} contradict each other; give one "
                           "expert layout")
    return flag or o["expert_layout"] or "sequential"


def _dtype(o: dict) -> str | None:
    """--dtype, --bf16 and --fp16 name one dtype; two different ones are a contradiction, not "the last wins"."""
    given = {f"--dtype {o['dtype']}": o["dtype"]} if o["dtype"] else {}
    given |= {f"--{flag}": flag for flag in ("bf16", "fp16") if o[flag]}
    if len({DTYPES[v] for v in given.values()}) > 1:
        raise ConvertError(f"{' and '.join(given)} contradict each other; give one dtype")
    return DTYPES[next(iter(given.values()))] if given else None


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--loader", help="Format of PATH; detected when omitted.")
@click.option("--true-vocab-size", type=POSITIVE, help="Real vocabulary size of a padded (Megatron) source.")
@click.option("--tensors/--no-tensors", default=True, show_default=True, help="Print the table of tensors.")
@click.option("--values/--no-values", default=True, show_default=True,
              help="Read every tensor once to report NaN and infinite values (--no-values reads no tensor data).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_fail_cleanly
def inspect(path: Path, loader: str | None, true_vocab_size: int | None, tensors: bool, values: bool,
            as_json: bool) -> None:
    """Show a checkpoint's format, config, layout, size, tensors and any NaN/Inf values."""
    from mconvert.options import Options
    from mconvert.tools.inspect import describe, report

    options = Options(true_vocab_size=true_vocab_size)
    if as_json:
        click.echo(json.dumps(report(path, loader, options, tensors=tensors, values=values), indent=1, default=str))
    else:
        click.echo(describe(path, loader, options, tensors=tensors, values=values))


@main.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--loader-a", help="Format of A; detected when omitted.")
@click.option("--loader-b", help="Format of B; detected when omitted.")
@click.option("--true-vocab-size", type=POSITIVE, help="Real vocabulary size, for padded (Megatron) checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (tensors: null where identical).")
@_fail_cleanly
def compare(a: Path, b: Path, loader_a: str | None, loader_b: str | None, true_vocab_size: int | None,
            as_json: bool) -> None:
    """Compare two checkpoints of the same model tensor by tensor (any formats, any layouts).

    Exits with status 1 when a config field or a tensor differs. A bos/eos/pad token id one side leaves unset
    while its own tokenizer names the other side's value is a note, not a difference.
    """
    from mconvert.options import Options
    from mconvert.tools.inspect import compare as run
    from mconvert.tools.inspect import comparison

    options = Options(true_vocab_size=true_vocab_size)
    if as_json:
        result = comparison(a, b, loader_a, loader_b, options)
        text, same = json.dumps(result, indent=1, default=str), result["same"]
    else:
        text, same = run(a, b, loader_a, loader_b, options)
    click.echo(text)
    if not same:
        raise SystemExit(1)


@main.command("verify")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--loader-a", help="Format of A; detected when omitted.")
@click.option("--loader-b", help="Format of B; detected when omitted.")
@click.option("--true-vocab-size", type=POSITIVE, help="Real vocabulary size, for padded (Megatron) checkpoints.")
@click.option("--tokens", type=POSITIVE, default=256, show_default=True,
              help="Random tokens to run, in sequences of --seq-len.")
@click.option("--seq-len", type=POSITIVE, default=128, show_default=True, help="Length of each sequence.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random tokens.")
@click.option("--prompt", help="Run this text, tokenized with a checkpoint's tokenizer, instead of random tokens.")
@click.option("--device", default="cpu", show_default=True, help="Where to run: cpu, cuda, cuda:1, ...")
@click.option("--reference", type=click.Choice(["transformers"]),
              help="Run the Hugging Face side with transformers itself instead of mtrain's model.")
@click.option("--per-layer", is_flag=True, help="Show the difference after every stage (tables, layers, MTP modules).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@_fail_cleanly
def verify_command(a: Path, b: Path, loader_a, loader_b, true_vocab_size, per_layer, as_json, quiet, **given) -> None:
    """Run A and B on the same tokens and check that they compute the same thing (any formats and layouts).

    Reports the max |logit difference|, the mean KL divergence and the top-1 agreement. Exits with status 1
    unless the logits and every stage agree (exactly when both hold the same dtypes; within the measured effect
    of rounding when a conversion cast them), every tensor is equal (in a cast: to its nearest-even rounding),
    and no config field that changes the outputs differs. The embedding and position tables run whole through
    each model's embedding, and MTP modules run as stages of their own.
    """
    from mconvert.options import Options
    from mconvert.progress import Progress
    from mconvert.tools.verify import VerifySettings, verify
    from mconvert.tools.verify.report import text, to_json

    settings = VerifySettings(loader_a=loader_a, loader_b=loader_b, options=Options(true_vocab_size=true_vocab_size),
                              **given)
    report = verify(a, b, settings, Progress(enabled=not (quiet or as_json)))
    click.echo(to_json(report) if as_json else text(report, per_layer))
    if not report.passed:
        raise SystemExit(1)


@main.command()
def plugins() -> None:
    """List the loaders and savers (built in and installed through entry points)."""
    groups = (("loaders", registry.loaders()), ("savers", registry.savers()))
    width = max(16, *(len(p.name) + 2 for _, items in groups for p in items))
    for title, items in groups:
        click.echo(f"{title}:")
        for p in items:
            alias = f" (aliases: {', '.join(p.aliases)})" if p.aliases else ""
            click.echo(f"  {p.name:<{width}}{p.help}{alias}")
