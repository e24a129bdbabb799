"""Zero-shot tasks on files the user gives (nothing is downloaded).

Last-word accuracy (LAMBADA-style, `mtrain evaluate --lambada FILE.jsonl`). Each line of the file is a JSON
object whose "text" is a passage; the task is to predict its last word from everything before it:

    "… she handed him the cup of tea"   ->   context "… she handed him the cup of"   target " tea"

  context = the text up to the last whitespace, encoded as the tokenizer encodes any text (a BOS if it adds one);
  target  = the last word with the whitespace before it, encoded alone without special tokens;
  the model reads context + target[:-1] once, and the passage counts as correct when the most likely token
  (argmax) at every target position is the target's token: the whole word, greedily, as Megatron-LM's strict
  LAMBADA scoring does. accuracy = correct passages / passages.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mtrain.data.tokenizer import Tokenizer
from mtrain.errors import TrainError
from mtrain.models.model import Transformer


@dataclass(frozen=True)
class LastWordResult:
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


@dataclass(frozen=True)
class Passage:
    context: list[int]
    target: list[int]


def read_passages(path: Path, tokenizer: Tokenizer, *, key: str = "text", max_samples: int | None = None,
                  max_positions: int | None = None) -> list[Passage]:
    """The passages of a JSON-lines file, tokenized as the module docstring says."""
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"task file {path} not found (JSON lines with a {key!r} field)")
    out: list[Passage] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TrainError(f"{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1})") from None
            if not line.strip():
                continue
            if max_samples is not None and len(out) >= max_samples:
                break
            where = f"{path}:{number}"
            try:
                text = json.loads(line)[key]
            except (json.JSONDecodeError, TypeError, KeyError, RecursionError):
                raise TrainError(f"{where}: expected a JSON object with a {key!r} text field") from None
            if not isinstance(text, str):
                raise TrainError(f"{where}: {key!r} must be text, found {type(text).__name__}")
            text = text.strip()
            cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"))
            if cut <= 0:
                raise TrainError(f"{where}: the passage needs a context and a last word, found {text!r}")
            passage = Passage(tokenizer.encode(text[:cut]), tokenizer.encode(text[cut:], special=False))
            if not passage.context or not passage.target:
                raise TrainError(f"{where}: the context or the last word encodes to no tokens")
            length = len(passage.context) + len(passage.target) - 1
            if max_positions is not None and length > max_positions:
                raise TrainError(f"{where}: the passage is {length} tokens, longer than the model's {max_positions} "
                                 "positions")
            out.append(passage)
    if not out:
        raise TrainError(f"task file {path} holds no passages")
    return out


@torch.no_grad()
def last_word_accuracy(model: Transformer, passages: list[Passage], *, batch_size: int = 8,
                       progress: Callable[[int, int], None] | None = None) -> LastWordResult:
    """Greedy whole-word accuracy. Passages of a batch are right-padded: with causal attention the padding
    after a passage cannot change the predictions inside it."""
    correct = 0
    for start in range(0, len(passages), batch_size):
        batch = passages[start:start + batch_size]
        inputs = [p.context + p.target[:-1] for p in batch]
        tokens = torch.zeros(len(batch), max(map(len, inputs)), dtype=torch.long)
        for row, ids in enumerate(inputs):
            tokens[row, :len(ids)] = torch.tensor(ids)
        if int(tokens.max()) >= model.config.vocab_size:
            raise TrainError(f"the tokenizer gives token id {int(tokens.max())}, outside the model's vocabulary of "
                             f"{model.config.vocab_size}: is it this model's tokenizer?")
        predicted = model(tokens).argmax(dim=-1)  # (B, T): the prediction for the token after each position
        for row, p in enumerate(batch):
            first = len(p.context) - 1  # the position whose next token is the target's first
            correct += predicted[row, first:first + len(p.target)].tolist() == p.target
        if progress is not None:
            progress(min(start + batch_size, len(passages)), len(passages))
    return LastWordResult(correct, len(passages))
