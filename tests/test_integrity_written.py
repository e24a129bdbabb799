"""integrity.json of torch_dist output, hashed while the files are written (mconvert.io.integrity.WriteDigest):
the same SHA-256 digests a second pass over the finished files gives, without that second pass."""

from __future__ import annotations

import hashlib
import json
import math
import os

import pytest
import torch

from mconvert.io import dcp_writer, hf_dir, integrity
from mconvert.io.dcp import DcpReader
from tests.support.cli import run_cli

IT = "iter_0000001"


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Recording(integrity.WriteDigest):
    """A WriteDigest that remembers, per file, how many bytes it hashed in all and from memory."""

    seen: dict[str, tuple[int, int]] = {}

    def hexdigest(self) -> str:
        digest = super().hexdigest()
        _Recording.seen[os.path.basename(self._f.name)] = (self.position, self.fed)
        return digest


@pytest.mark.parametrize(("family", "workers"), [("llama", "1"), ("llama", "3"), ("mixtral", "2")])
def test_manifest_hashed_as_written(family, workers, hf_model, tmp_path, monkeypatch):
    second_pass = []
    real = integrity.file_digest
    monkeypatch.setattr(integrity, "file_digest", lambda path: second_pass.append(path.name) or real(path))
    monkeypatch.setattr(dcp_writer, "WriteDigest", _Recording)
    _Recording.seen = {}
    out = tmp_path / "dist"
    run_cli("-q", "--saver", "core", "--ckpt-format", "torch_dist", "--workers", workers, "--load-dir",
            hf_model(family), "--save-dir", out)
    it = out / IT
    manifest = json.loads((it / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == sorted(p.name for p in it.iterdir() if p.is_file() and
                                               p.name != "integrity.json")
    assert manifest["files"] == {name: _sha256(it / name) for name in manifest["files"]}
    shards = [name for name in manifest["files"] if name.endswith(".distcp")]
    assert shards and not set(shards) & set(second_pass)  # no .distcp file read back to hash it
    assert sorted(_Recording.seen) == sorted(shards)
    for name in shards:  # every byte hashed once
        assert _Recording.seen[name][0] == (it / name).stat().st_size
    # The tensor bytes, all of them, from memory (only headers, pickles and padding read back).
    assert sum(fed for _, fed in _Recording.seen.values()) == _tensor_bytes(it)
    run_cli("-q", "--saver", "llama_mistral" if family == "llama" else "mixtral_hf", "--load-dir", out,
            "--save-dir", tmp_path / "back")  # read back with the manifest verified
    run_cli("compare", hf_model(family), tmp_path / "back")


def _tensor_bytes(it) -> int:
    """Bytes of every tensor chunk `.metadata` lists."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for meta in FileSystemReader(str(it)).read_metadata().state_dict_metadata.values():
        if isinstance(meta, TensorStorageMetadata):
            total += sum(math.prod(c.sizes) * meta.properties.dtype.itemsize for c in meta.chunks)
    return total


def test_write_digest_reads_back_what_was_not_fed(tmp_path):
    """Bytes written behind the digest's back (a header rewritten after its data, a tail) are read back in file
    order; fed bytes are not read again; feeding bytes before what is already hashed is refused."""
    path = tmp_path / "f"
    with open(path, "w+b") as f:
        digest = integrity.WriteDigest(f)
        f.write(b"H" * 30)  # a placeholder header ...
        data = bytes(range(256)) * 1000
        f.write(data)
        f.seek(0)
        f.write(b"h" * 30)  # ... rewritten once its data is out
        f.seek(0, os.SEEK_END)
        digest.feed(30, data)
        f.write(b"tail")
        with pytest.raises(ValueError, match="already hashed"):
            digest.feed(10, b"x")
        assert digest.hexdigest() == _sha256(path)
        assert digest.fed == len(data)


def test_no_integrity_manifest_skips_hashing(hf_model, tmp_path, monkeypatch):
    """--no-integrity-manifest: no integrity.json and not a byte hashed (no WriteDigest, no second pass); the
    output reads back to the same model. Refused where it means nothing: another --ckpt-format (no manifest
    there) or a saver without one."""
    made, second_pass = [], []
    monkeypatch.setattr(dcp_writer, "WriteDigest", lambda f: made.append(f) or integrity.WriteDigest(f))
    monkeypatch.setattr(integrity, "file_digest", lambda path: second_pass.append(path) or "")
    out = tmp_path / "dist"
    run_cli("-q", "--saver", "core", "--ckpt-format", "torch_dist", "--no-integrity-manifest", "--workers", "2",
            "--load-dir", hf_model("llama"), "--save-dir", out)
    assert sorted(p.name for p in (out / IT).iterdir() if p.name.endswith(".distcp"))  # written ...
    assert not (out / IT / "integrity.json").exists() and made == [] and second_pass == []  # ... unhashed
    run_cli("-q", "--saver", "llama_mistral", "--load-dir", out, "--save-dir", tmp_path / "back")
    run_cli("compare", hf_model("llama"), tmp_path / "back")

    out = run_cli("--saver", "core", "--ckpt-format", "torch_dcp", "--no-integrity-manifest", "--load-dir",
                  hf_model("llama"), "--save-dir", tmp_path / "dcp", expect_error=True)
    assert out.strip() == ("Error: --no-integrity-manifest: only --ckpt-format torch_dist has an integrity manifest "
                           "(integrity.json); --ckpt-format torch_dcp writes none anyway")
    out = run_cli("--saver", "llama_mistral", "--no-integrity-manifest", "--load-dir", hf_model("llama"),
                  "--save-dir", tmp_path / "hf", expect_error=True)
    assert out.strip() == "Error: --no-integrity-manifest does not apply to loader llama_mistral / saver llama_mistral"
    assert not (tmp_path / "dcp").exists() and not (tmp_path / "hf").exists()


def test_no_verify_integrity_reads_without_hashing(hf_model, tmp_path, monkeypatch):
    """--no-verify-integrity: a torch_dist source's files are read without a byte hashed, so a changed weight is
    converted as it is; by default the same file is refused by name. Refused for a loader it means nothing to."""
    src = tmp_path / "dist"
    run_cli("-q", "--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", hf_model("llama"), "--save-dir", src)
    it = src / IT
    [piece] = DcpReader(it).elements("embedding.word_embeddings.weight").pieces
    where = piece.file_bytes  # little-endian: the first weight's sign bit is the top bit of its last byte
    with open(where.path, "r+b") as f:
        f.seek(where.offset + piece.dtype.itemsize - 1)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x80]))
    out = run_cli("--saver", "llama_mistral", "--load-dir", src, "--save-dir", tmp_path / "hf", expect_error=True)
    assert f"{where.path}: SHA-256 " in out and "does not match" in out
    assert not (tmp_path / "hf").exists()

    hashed = []
    real = integrity._digest
    monkeypatch.setattr(integrity, "_digest", lambda data: hashed.append(len(data)) or real(data))
    run_cli("-q", "--saver", "llama_mistral", "--no-verify-integrity", "--load-dir", src, "--save-dir",
            tmp_path / "hf")
    assert hashed == []
    original = hf_dir.open_weights(hf_model("llama"))["model.embed_tokens.weight"].load()
    converted = hf_dir.open_weights(tmp_path / "hf")["model.embed_tokens.weight"].load().clone()
    assert torch.equal(converted[0, 0], -original[0, 0])  # the change went through ...
    converted[0, 0] = original[0, 0]
    assert torch.equal(converted, original)  # ... and nothing else changed

    out = run_cli("--loader", "llama_mistral", "--saver", "core", "--no-verify-integrity", "--load-dir",
                  hf_model("llama"), "--save-dir", tmp_path / "core", expect_error=True)
    assert out.strip() == "Error: --no-verify-integrity does not apply to loader llama_mistral / saver core"
