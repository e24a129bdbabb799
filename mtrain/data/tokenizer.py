"""Tokenizers for preprocessing and generation: a Hugging Face tokenizer or a sentencepiece model.

    tokenizer.json (a file, or a directory holding one)   -> the `tokenizers` library
    a directory with other HF tokenizer files             -> transformers.AutoTokenizer (local files only)
    *.model (sentencepiece)                               -> sentencepiece
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert.io import hf_dir
from mtrain.errors import TrainError


@dataclass
class Tokenizer:
    kind: str
    path: Path
    impl: Any
    eod_id: int | None
    vocab_size: int

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; `special=False` leaves out what the tokenizer adds around it (e.g. a BOS)."""
        if self.kind == "tokenizers":
            return self.impl.encode(text, add_special_tokens=special).ids
        if self.kind == "sentencepiece":
            return self.impl.encode(text)
        return self.impl(text, add_special_tokens=special)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode(ids)

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "[MASK]"), or None when the vocabulary has no such entry."""
        if self.kind == "tokenizers":
            return self.impl.token_to_id(token)
        if self.kind == "sentencepiece":
            found = self.impl.piece_to_id(token)
            return found if self.impl.id_to_piece(found) == token else None
        return self.impl.get_vocab().get(token)


def checkpoint_tokenizer(assets: dict[str, Path]) -> Path | None:
    """The tokenizer among a checkpoint's files (`ModelIR.assets`): its tokenizer.json directory, or its
    sentencepiece tokenizer.model; None when it carries neither."""
    if "tokenizer.json" in assets:
        return Path(assets["tokenizer.json"]).parent
    if "tokenizer.model" in assets:
        return Path(assets["tokenizer.model"])
    return None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`; the end-of-document id is the tokenizer's eos token when it names one."""
    path = Path(path)
    if not path.exists():
        raise TrainError(f"tokenizer {path} not found: give a tokenizer.json, a tokenizer directory or a "
                         "sentencepiece .model file")
    if path.is_file() and path.suffix == ".model":
        return _sentencepiece(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return _tokenizers(path / "tokenizer.json", path)
    if path.is_file() and path.suffix == ".json":
        return _tokenizers(path, path.parent)
    if path.is_dir() and (path / "tokenizer.model").is_file() and not (path / "tokenizer_config.json").is_file():
        return _sentencepiece(path / "tokenizer.model")
    if path.is_dir() and not hf_dir.tokenizer_files(path):
        raise TrainError(f"{path}: holds no tokenizer files (expected tokenizer.json, tokenizer_config.json with its "
                         "vocabulary files, or a sentencepiece tokenizer.model)")
    if path.is_dir():
        return _auto(path)
    raise TrainError(f"{path}: not a tokenizer (expected tokenizer.json, a tokenizer directory or a .model file)")


def _tokenizers(file: Path, directory: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    _json_object(file)  # the library's own errors for a list or a non-UTF-8 file are panics, not messages
    try:
        impl = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception for any file it cannot read
        raise TrainError(f"{file}: not a tokenizers tokenizer.json ({str(e).splitlines()[0][:200]})") from None
    eos = _eos_from_config(directory)
    eod = impl.token_to_id(eos) if eos else None
    return Tokenizer("tokenizers", file, impl, eod, impl.get_vocab_size(with_added_tokens=True))


def _eos_from_config(directory: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = directory / name
        if f.is_file():
            eos = _json_object(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos:
                return eos
    return None


def _json_object(path: Path) -> dict:
    """The JSON object in `path`; anything else (a list, not JSON, not UTF-8, nested past the parser) is refused
    naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TrainError(f"{path}: not readable JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise TrainError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _sentencepiece(file: Path) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError:
        raise TrainError(f"{file} is a sentencepiece model: install sentencepiece (pip install 'mconvert[train]')") \
            from None
    try:
        impl = sentencepiece.SentencePieceProcessor(model_file=str(file))
    except (OSError, RuntimeError) as e:
        raise TrainError(f"{file}: not a sentencepiece model ({str(e).splitlines()[0][:200]})") from None
    eos = impl.eos_id()
    return Tokenizer("sentencepiece", file, impl, eos if eos >= 0 else None, impl.get_piece_size())


def _auto(directory: Path) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TrainError(f"{directory}: reading this tokenizer needs transformers (pip install 'mconvert[hub]')") \
            from None
    try:
        impl = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise TrainError(f"{directory}: not a tokenizer directory ({type(e).__name__}: {e})") from None
    return Tokenizer("transformers", directory, impl, impl.eos_token_id, len(impl))
