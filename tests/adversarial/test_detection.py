"""Detection: without --loader, a checkpoint recognisably of one format but broken reports that format's own
error (the file and what is wrong), not "cannot tell the checkpoint format"."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.adversarial.crafting import payloads
from tests.support.refusals import cli, convert_refused, fresh, refused


@pytest.mark.parametrize("family", ["llama_mistral", "gpt2_hf", "mixtral_hf"])
@pytest.mark.parametrize("text", ['{"model_type": "llama", ', "[1, 2", "\xff\xfe not text", '{"a": ' * 100000])
def test_malformed_config_json(sources, tmp_path, family, text):
    src = fresh(sources[family], tmp_path)
    (src / "config.json").write_bytes(text.encode("latin-1"))
    out = convert_refused(src, tmp_path, culprits=("config.json", "not valid JSON"))
    assert "cannot tell the checkpoint format" not in out


@pytest.mark.parametrize("tracker", ["", "latest", "12abc", "-1", "release\nrelease"])
@pytest.mark.parametrize("fmt", ["core", "legacy", "torch_dist"])
def test_bad_tracker_file(sources, tmp_path, fmt, tracker):
    src = fresh(sources[fmt], tmp_path)
    (src / "latest_checkpointed_iteration.txt").write_text(tracker)
    out = convert_refused(src, tmp_path, culprits=("latest_checkpointed_iteration.txt",))
    assert "cannot tell the checkpoint format" not in out


def test_tracker_naming_a_missing_iteration(sources, tmp_path):
    src = fresh(sources["core"], tmp_path)
    (src / "latest_checkpointed_iteration.txt").write_text("77")
    convert_refused(src, tmp_path, culprits=("names iteration 77", "iter_0000077"))


@pytest.mark.parametrize("fmt", ["core", "legacy"])
@pytest.mark.parametrize("damage", ["refused pickle", "not a zip", "empty file", "not a dict", "no model entry"])
def test_broken_first_rank_file(sources, tmp_path, marker, fmt, damage):
    src = fresh(sources[fmt], tmp_path)
    f = sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))[0]
    if damage == "refused pickle":
        torch.save({"model": payloads(marker)["os.system"]}, f)
    elif damage == "not a zip":
        f.write_bytes(pickle.dumps({"model": {}}))
    elif damage == "empty file":
        f.write_bytes(b"")
    elif damage == "not a dict":
        torch.save([1, 2, 3], f)
    else:
        torch.save({"args": None}, f)
    out = convert_refused(src, tmp_path, culprits=(f.parent.name, "model_optim_rng.pt"))
    assert "cannot tell the checkpoint format" not in out


@pytest.mark.parametrize("damage", ["metadata.json not JSON", "unknown backend", ".metadata missing"])
def test_broken_dist_checkpoint(sources, tmp_path, damage):
    src = fresh(sources["torch_dist"], tmp_path)
    it_dir = next(src.glob("iter_*"))
    if damage == "metadata.json not JSON":
        (it_dir / "metadata.json").write_text("{")
        named = "metadata.json"
    elif damage == "unknown backend":
        (it_dir / "metadata.json").write_text('{"sharded_backend": "pickle_me"}')
        named = "unknown sharded_backend 'pickle_me'"
    else:
        (it_dir / ".metadata").unlink()
        named = "no .metadata file"
    convert_refused(src, tmp_path, culprits=(named,))


def test_mtrain_run_with_a_broken_step(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    (run / "step_0000002" / "mtrain.json").write_text("[]")
    refused(cli("inspect", run, expect_error=True), "mtrain.json", "expected a JSON object")


def test_nothing_recognisable_still_says_so(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hello")
    convert_refused(tmp_path / "src", tmp_path, culprits=("cannot tell the checkpoint format", "--loader"))
