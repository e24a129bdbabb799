"""Links planted after the source was checked: tokenizer files are checked when the source is opened and copied
verbatim at the very end, so a file swapped for a link in between must not be followed out of the checkpoint.
The swap is staged deterministically, right after the source is loaded (before any output is written)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.io.contained import open_inside
from tests.support.cli import run_cli
from tests.support.refusals import fresh, refused


def _after_loading(monkeypatch, act) -> None:
    original = engine.load

    def hooked(*args, **kwargs):
        ir = original(*args, **kwargs)
        act()
        return ir

    monkeypatch.setattr(engine, "load", hooked)


@pytest.mark.parametrize("saver", ["llama_mistral", "core"])
def test_a_tokenizer_file_swapped_for_a_link_is_not_followed(sources, outside, tmp_path, monkeypatch, saver):
    src = fresh(sources["llama_mistral"], tmp_path)
    victim = src / "tokenizer_config.json"
    assert victim.is_file()

    def plant():
        victim.unlink()
        victim.symlink_to(outside / "secret.txt")

    _after_loading(monkeypatch, plant)
    out = run_cli("--saver", saver, "--load-dir", src, "--save-dir", tmp_path / "dst" / "out", "-q",
                  expect_error=True)
    refused(out, "tokenizer_config.json", "outside the checkpoint")
    assert "the secret" not in out
    assert not (tmp_path / "dst").exists() or os.listdir(tmp_path / "dst") == []


def test_a_tokenizer_dir_linking_out_is_refused_before_converting(sources, outside, tmp_path):
    """--tokenizer DIR is copied verbatim like a checkpoint's own tokenizer files, so it is held to the same rule,
    and checked before the conversion starts rather than failing at its end."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").symlink_to(outside / "secret.txt")
    out = run_cli("--saver", "llama_mistral", "--tokenizer", tok, "--load-dir", sources["llama_mistral"],
                  "--save-dir", tmp_path / "dst" / "out", "-q", expect_error=True)
    refused(out, "tokenizer.json", "outside the checkpoint")
    assert not (tmp_path / "dst").exists()


def test_open_inside_follows_links_within_and_refuses_others(tmp_path, outside):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "real.json").write_text("{}")
    (root / "within.json").symlink_to(root / "sub" / "real.json")
    with open_inside(root / "within.json") as f:
        assert f.read() == b"{}"
    (root / "outward.json").symlink_to(outside / "secret.txt")
    with pytest.raises(ConvertError, match="outward.json"):
        open_inside(root / "outward.json")
    os.mkfifo(root / "fifo.json")  # would block a plain open forever
    with pytest.raises(ConvertError, match="not a regular file"):
        open_inside(root / "fifo.json")


def test_a_swapped_parent_directory_is_caught_by_the_opened_path(tmp_path, outside):
    """The file's own name is not a link, but the directory above was swapped for one after the check: the
    path of the file actually opened shows it (Linux)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "tok").symlink_to(outside)
    with pytest.raises(ConvertError, match="outside the checkpoint"):
        open_inside(root / "tok" / "secret.txt", root)


def test_mtrain_follows_the_links_of_the_tokenizer_its_config_names(tmp_path, outside):
    """The tokenizer of an mtrain config is the user's own choice, not a checkpoint's content: a link in it to
    elsewhere (a shared copy) is followed when a checkpoint carries it, as before. A finetuned checkpoint's own
    tokenizer files are its content: a link out of it is refused."""
    from mtrain.checkpoint import read_tokenizer, tokenizer_files

    shared = tmp_path / "shared" / "tokenizer.json"
    shared.parent.mkdir()
    shared.write_text('{"shared": true}')
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").symlink_to(shared)
    files = tokenizer_files(mine, "data.tokenizer")
    assert read_tokenizer(files, users=True) == {"tokenizer.json": b'{"shared": true}'}
    (mine / "tokenizer_config.json").symlink_to(outside / "secret.txt")
    with pytest.raises(ConvertError, match="outside the checkpoint"):
        read_tokenizer({"tokenizer_config.json": mine / "tokenizer_config.json"}, users=False)
