"""The server's text handling without a model: a row's text as tokens arrive (stop strings, characters split
across tokens) and the JSON nesting measure that refuses deep bodies before json recurses into them."""

from __future__ import annotations

import pytest

from mtrain.generation import Emitted
from mtrain.serving.body import nesting_depth, parse_json
from mtrain.serving.fields import BadRequest
from mtrain.serving.text import GeneratedRow, TextStream


class BytesTokenizer:
    """Token i is the bytes PIECES[i]; decoding joins them and replaces what is not UTF-8 (as byte-level BPE)."""

    PIECES = [b"x", b"a", b"b", b"c", b"\xc3", b"\xa9", b" ", b"<eos>"]

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", "replace")


def feed(stream, ids):
    return [stream.add(i) for i in ids]


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    stream = TextStream(BytesTokenizer(), [0])
    assert feed(stream, [1, 4, 5, 2]) == ["a", "", "é", "b"]
    assert stream.text == "aéb" and stream.flush() == ""


def test_stop_strings_across_tokens_are_held_then_cut_or_released():
    stream = TextStream(BytesTokenizer(), [0], stops=["ab"])
    assert feed(stream, [0, 1, 3, 1, 2, 0]) == ["x", "", "ac", "", "", ""]  # "a" held until "c" shows it is no stop
    assert stream.stopped and stream.text == "xac"
    kept = TextStream(BytesTokenizer(), [0], stops=["ab"], keep_stop=True)
    assert feed(kept, [1, 2]) == ["", "ab"] and kept.text == "ab"
    ended = TextStream(BytesTokenizer(), [0], stops=["abc"])
    assert feed(ended, [0, 1, 2]) == ["x", "", ""] and ended.flush() == "ab"  # the end releases what was held


def test_the_prompt_decodes_before_the_new_tokens():
    """A new token's text is what it adds after the prompt: a character begun in the prompt completes."""
    stream = TextStream(BytesTokenizer(), [1, 4])  # "a" and the first byte of "é"
    assert feed(stream, [5, 1]) == ["é", "a"] and stream.text == "éa"


def test_a_row_ends_at_eos_or_its_length():
    eos = 7
    row = GeneratedRow(BytesTokenizer(), [0], max_new=3, eos_ids={eos})
    assert [row.add(Emitted(0, t)) for t in (1, eos, 2)] == ["a", "", ""]
    assert row.finish_reason == "stop" and row.tokens == [1, eos] and row.stream.text == "a"
    row = GeneratedRow(BytesTokenizer(), [0], max_new=2, eos_ids={eos}, stops=["bc"])
    assert [row.add(Emitted(0, t)) for t in (1, 2)] == ["a", "b"] and row.finish_reason == "length"


@pytest.mark.parametrize("text, depth", [
    ('{"a": [1, {"b": []}]}', 4),
    ('{"a": "[[[[{{{{"}', 1),
    ('{"a": "\\"[[[[\\\\", "b": [[]]}', 3),  # escaped quotes and backslashes stay inside the string
    ("5", 0),
])
def test_nesting_depth_counts_brackets_outside_strings(text, depth):
    assert nesting_depth(text) == depth


def test_parse_json_refuses_what_json_would_accept():
    with pytest.raises(BadRequest, match="holds Infinity, which is not a JSON number"):
        parse_json(b'{"a": Infinity}')
    with pytest.raises(BadRequest, match="the body nests 33 levels"):
        parse_json(b"[" * 33 + b"]" * 33)
    value = parse_json(b"[" * 32 + b"]" * 32)  # 32 levels are read
    for _ in range(31):
        value = value[0]
    assert value == []
