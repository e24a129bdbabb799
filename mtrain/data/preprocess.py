"""`mtrain preprocess`: JSON lines -> Megatron indexed datasets, one per JSON key.

    {"text": "first document"}            ->  {prefix}_text_document.bin / .idx
    {"text": "second document"}               one sequence per document, tokens as uint16 (vocab < 65500)
                                              or int32, optionally followed by the end-of-document token

With `split_sentences` (BERT's data, Megatron's --split-sentences) a document is one sequence per sentence, each
tokenized without the tokenizer's special tokens (BERT's samples add [CLS] and [SEP]); the end-of-document token
ends its last sentence. Sentences end at ".", "!" or "?" (closing quotes or brackets included) before whitespace,
and at line breaks: a rule, not nltk's punkt model, which Megatron uses.

Tokenization runs in `workers` processes (in input order); the output files appear only when complete. A worker
that dies (the out-of-memory killer's SIGKILL) fails the run with an error, leaving no output: a process pool
notices the death (concurrent.futures' BrokenProcessPool), where multiprocessing.Pool would wait forever for the
chunk it was tokenizing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import multiprocessing
import re
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from mtrain.data.indexed import IndexedDatasetWriter, token_dtype
from mtrain.data.tokenizer import Tokenizer, load_tokenizer
from mtrain.errors import TrainError


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    input: Path
    output_prefix: str
    tokenizer: Path
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    split_sentences: bool = False
    workers: int = 1
    chunk_size: int = 64


@dataclass(frozen=True)
class Progress:
    """How far a preprocess run is: documents and tokens written, bytes of the input done (of `total_bytes`)."""

    documents: int
    tokens: int
    bytes_read: int
    total_bytes: int
    done: bool = False


PROGRESS_EVERY = 1000  # documents between progress reports (and one at the end)


@dataclass(frozen=True)
class PreprocessResult:
    prefixes: dict[str, str]  # json key -> dataset prefix
    documents: int
    tokens: dict[str, int]
    skipped_empty: dict[str, int]


_worker_state: dict = {}


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\s*\n\s*")


def split_sentences(text: str) -> list[str]:
    """The sentences of `text` (module docstring), without surrounding whitespace; none empty."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    return [s for s in (text[a:b].strip() for a, b in zip([0, *ends], [*ends, len(text)])) if s]


def _init_worker(tokenizer_path: str, keys: tuple[str, ...], append_eod: bool, eod: int | None, where: str,
                 sentences: bool = False) -> None:
    _worker_state.update(tokenizer=load_tokenizer(tokenizer_path), keys=keys, append_eod=append_eod, eod=eod,
                         where=where, sentences=sentences)


def _encode(item: tuple[int, str, int]) -> tuple[int, dict[str, list[int] | list[list[int]]]]:
    """(the line's bytes, its token ids by key: a list of sentences' ids with split_sentences)."""
    number, line, size = item
    s = _worker_state
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise TrainError(f"{s['where']}, line {number}: not valid JSON ({e.msg})") from None
    except RecursionError:  # json's decoder recurses once per level: [[[[...]]]] a few thousand deep
        raise TrainError(f"{s['where']}, line {number}: JSON nested too deeply to read; a document is an object "
                         "with text fields") from None
    if not isinstance(record, dict):
        raise TrainError(f"{s['where']}, line {number}: expected a JSON object, found {type(record).__name__}")
    out = {}
    for key in s["keys"]:
        if key not in record:
            raise TrainError(f"{s['where']}, line {number}: no key {key!r} (keys: {', '.join(record)}); "
                             "choose the text field with --json-key")
        if s["sentences"]:
            sentences = [ids for text in split_sentences(str(record[key]))
                         if (ids := s["tokenizer"].encode(text, special=False))]
            if sentences and s["append_eod"]:
                sentences[-1].append(s["eod"])
            out[key] = sentences
            continue
        ids = s["tokenizer"].encode(str(record[key]))
        if ids and s["append_eod"]:
            ids.append(s["eod"])
        out[key] = ids
    return size, out


def _encode_chunk(items: list[tuple[int, str, int]]) -> list[tuple[int, dict[str, list[int]]]]:
    return [_encode(item) for item in items]


def _lines(path: Path) -> Iterator[tuple[int, str, int]]:
    """The non-blank lines of `path` with their numbers and sizes in bytes (the blank lines before one included)."""
    size = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            size += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TrainError(f"{path}, line {number}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1}); JSON lines are UTF-8") from None
            if line.strip():
                yield number, line, size
                size = 0


def preprocess(cfg: PreprocessConfig, tokenizer: Tokenizer | None = None,
               progress: Callable[[Progress], None] | None = None) -> PreprocessResult:
    """Tokenize cfg.input into one indexed dataset per JSON key; `progress` is called every PROGRESS_EVERY documents
    and once at the end."""
    if not cfg.input.is_file():
        raise TrainError(f"input file {cfg.input} not found (expected JSON lines, one document per line)")
    if cfg.workers < 1:
        raise TrainError(f"--workers must be at least 1, got {cfg.workers}")
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
    if cfg.append_eod and tokenizer.eod_id is None:
        raise TrainError(f"--append-eod: the tokenizer {cfg.tokenizer} names no end-of-document (eos) token")
    dtype = token_dtype(tokenizer.vocab_size)
    prefixes = {key: f"{cfg.output_prefix}_{key}_document" for key in cfg.json_keys}
    Path(cfg.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    writers = {key: IndexedDatasetWriter(prefix, dtype) for key, prefix in prefixes.items()}
    tokens = dict.fromkeys(cfg.json_keys, 0)
    skipped = dict.fromkeys(cfg.json_keys, 0)
    documents = 0
    init_args = (str(cfg.tokenizer), cfg.json_keys, cfg.append_eod, tokenizer.eod_id, str(cfg.input),
                 cfg.split_sentences)
    read, total = 0, cfg.input.stat().st_size

    def report(done: bool = False) -> None:
        if progress is not None:
            progress(Progress(documents, sum(tokens.values()), total if done else read, total, done))

    try:
        for size, doc in _encoded(cfg, init_args):
            documents += 1
            read += size
            for key, ids in doc.items():
                if not ids:
                    skipped[key] += 1  # Megatron's indices cannot hold an empty sequence usefully
                    continue
                if cfg.split_sentences:
                    writers[key].add_document(sentences=ids)
                    tokens[key] += sum(len(sentence) for sentence in ids)
                else:
                    writers[key].add_document(ids)
                    tokens[key] += len(ids)
            if documents % PROGRESS_EVERY == 0:
                report()
        for w in writers.values():
            w.finalize()
        report(done=True)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return PreprocessResult(prefixes, documents, tokens, skipped)


def _encoded(cfg: PreprocessConfig, init_args: tuple) -> Iterator[tuple[int, dict[str, list[int]]]]:
    if cfg.workers == 1:
        _init_worker(*init_args)
        yield from map(_encode, _lines(cfg.input))
        return
    # spawn, not fork: the parent may hold threads (torch, tokenizers) that a fork would copy mid-flight.
    ctx = multiprocessing.get_context("spawn")
    lines = _lines(cfg.input)
    chunks = iter(lambda: list(itertools.islice(lines, cfg.chunk_size)), [])
    with concurrent.futures.ProcessPoolExecutor(cfg.workers, mp_context=ctx, initializer=_init_worker,
                                                initargs=init_args) as pool:
        try:
            # In input order, with a bounded number of chunks in flight (memory stays flat for any input size).
            window = itertools.islice(chunks, 2 * cfg.workers)
            pending = collections.deque(pool.submit(_encode_chunk, c) for c in window)
            while pending:
                done = pending.popleft().result()
                pending.extend(pool.submit(_encode_chunk, c) for c in itertools.islice(chunks, 1))
                yield from done
        except BrokenProcessPool:
            raise TrainError(f"tokenizing {cfg.input}: a worker process died (killed, by the out-of-memory killer?); "
                             "nothing was written. Run again with fewer --workers, or more memory") from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
