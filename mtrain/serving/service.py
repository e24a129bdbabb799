"""What the protocol layers (megatron_api.py, openai_api.py) share: the tokenizer, the scheduler, the limits."""

from __future__ import annotations

from dataclasses import dataclass

from mtrain.data.tokenizer import Tokenizer
from mtrain.errors import TrainError
from mtrain.generation import check_fits
from mtrain.models.model import Transformer
from mtrain.serving.chat_template import ChatTemplate
from mtrain.serving.fields import BadRequest
from mtrain.serving.scheduler import Scheduler


@dataclass(frozen=True)
class Limits:
    max_prompts: int = 32  # rows of one request: prompts (times n for OpenAI's choices)
    max_tokens_to_generate: int = 1024
    max_request_bytes: int = 1 << 20


@dataclass
class Service:
    model: Transformer
    tokenizer: Tokenizer
    scheduler: Scheduler
    eos_ids: frozenset[int]
    limits: Limits
    model_name: str
    chat_template: ChatTemplate | None = None

    def encode(self, text: str, param: str, special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, special)
        if not ids:
            raise BadRequest(f"{param} encodes to no tokens", param.split("[")[0])
        return ids

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{param} holds token id {bad[0]}, outside the model's vocabulary of {vocab} (ids 0 to "
                             f"{vocab - 1})", param.split("[")[0])
        if not ids:
            raise BadRequest(f"{param} holds no tokens", param.split("[")[0])
        return ids

    def check_fits(self, ids: list[int], new_tokens: int, what: str, param: str) -> None:
        try:
            check_fits(self.model.config, len(ids), new_tokens)
        except TrainError as e:
            raise BadRequest(f"{what}: {e}", param) from None

    def check_rows(self, rows: int, what: str, param: str) -> None:
        if rows > self.limits.max_prompts:
            raise BadRequest(f"{what} make {rows} sequences to generate; this server takes at most "
                             f"{self.limits.max_prompts} per request", param)
