"""A generated row's text as its tokens arrive.

The text of new tokens is what decoding them after the prompt adds to decoding the prompt (decoding them alone
would lose the spaces and merges a tokenizer puts between tokens); the last CONTEXT prompt tokens stand for the
prompt. What could still change or be cut is held back until it is settled:

    a trailing U+FFFD    a character whose bytes are split across tokens, completed by a later token
    a stop string's start   "…Obs" while "Observation:" is a stop string: sent once the text goes elsewhere
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mtrain.data.tokenizer import Tokenizer
from mtrain.generation import Emitted

CONTEXT = 8  # prompt tokens decoded before the new ones


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], stops: Sequence[str] = (),
                 keep_stop: bool = False):
        self.tokenizer, self.context = tokenizer, list(prompt[-CONTEXT:])
        # a character the prompt's last bytes begin is the new tokens' once they complete it
        self.prefix = tokenizer.decode(self.context).rstrip("\ufffd") if self.context else ""
        self.stops, self.keep_stop = [s for s in stops if s], keep_stop
        self.ids: list[int] = []
        self.text = ""  # the text so far, cut at a stop string
        self.sent = 0  # characters of self.text handed out
        self.stopped = False  # a stop string appeared

    def add(self, token: int) -> str:
        """Take the next token; the text that is now settled and not handed out before."""
        if self.stopped:
            return ""
        self.ids.append(token)
        full = self.tokenizer.decode(self.context + self.ids)
        self.text = full[len(self.prefix):] if full.startswith(self.prefix) else self.tokenizer.decode(self.ids)
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0]
        if hits:
            i, stop = min(hits)
            self.text = self.text[:i + len(stop) if self.keep_stop else i]
            self.stopped = True
            return self.flush()
        end = len(self.text) - max(self._held(), len(self.text) - len(self.text.rstrip("\ufffd")))
        return self._hand_out(max(end, self.sent))

    def flush(self) -> str:
        """The text not handed out yet (at the end of the row)."""
        return self._hand_out(len(self.text))

    def _held(self) -> int:
        """Characters at the end that begin a stop string."""
        return max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def _hand_out(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


class GeneratedRow:
    """One row's tokens, log-probabilities and text as a job's results arrive, and why it ended: "stop" (an
    eos token, left out of the text, or a stop string) or "length" (max_new tokens)."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], max_new: int, eos_ids: Collection[int],
                 stops: Sequence[str] = (), keep_stop: bool = False):
        self.stream = TextStream(tokenizer, prompt, stops, keep_stop)
        self.max_new, self.eos_ids = max_new, eos_ids
        self.emitted: list[Emitted] = []  # the tokens kept (up to the one that ended the row)
        self.finish_reason: str | None = None

    def add(self, e: Emitted) -> str:
        """The new settled text ("" once the row has ended)."""
        if self.finish_reason:
            return ""
        self.emitted.append(e)
        if e.token in self.eos_ids:
            self.finish_reason = "stop"
            return self.stream.flush()
        delta = self.stream.add(e.token)
        if self.stream.stopped:
            self.finish_reason = "stop"
        elif len(self.emitted) >= self.max_new:
            self.finish_reason = "length"
            delta += self.stream.flush()
        return delta

    def end(self) -> str:
        """The row is done: the text still held back."""
        self.finish_reason = self.finish_reason or "length"
        return self.stream.flush()

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.emitted]
