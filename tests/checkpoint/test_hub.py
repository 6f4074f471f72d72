"""Models by name: a directory as it is, a hub id from the Hugging Face cache (populated here with the fixture
model in the hub's own layout), clear errors otherwise. Nothing here touches the network: the id resolutions run
in a subprocess with HF_HUB_OFFLINE=1 and the cache in a temporary HF_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cosystream.checkpoint.hub import DEFAULT_MODEL_ID, ModelNotFound, is_model_id, resolve_model

REPO_ID = "TestOrg/CosyVoice2-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

_RESOLVE = """
import json, sys
from cosystream.checkpoint import load_checkpoint
from cosystream.checkpoint.hub import ModelNotFound, resolve_model
try:
    path = resolve_model(sys.argv[1])
    print(json.dumps({"dir": str(path), "llm_layers": load_checkpoint(path).hparams.llm.num_layers}))
except ModelNotFound as exc:
    print(json.dumps({"error": str(exc)}))
"""


def _populate_hub_cache(hub_cache: Path, repo_id: str, model_dir: Path) -> Path:
    """The layout huggingface_hub writes: blobs, a snapshot of links to them under the commit, refs/main."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for source in model_dir.rglob("*"):
        if source.is_file():
            target = snapshot / source.relative_to(model_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source.resolve())
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def _resolve_offline(name: str, hf_home: Path) -> dict:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", _RESOLVE, name], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hf_home(model_dir, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    _populate_hub_cache(home / "hub", REPO_ID, model_dir)
    return home


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(hf_home, checkpoint):
    answer = _resolve_offline(REPO_ID, hf_home)
    assert answer["dir"] == str(hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT)
    assert answer["llm_layers"] == checkpoint.hparams.llm.num_layers  # a loadable model dir


def test_an_uncached_id_offline_says_what_is_missing(hf_home):
    error = _resolve_offline("TestOrg/not-downloaded", hf_home)["error"]
    assert "TestOrg/not-downloaded" in error and "HF_HUB_OFFLINE" in error and str(hf_home / "hub") in error


def test_a_modelscope_id_without_modelscope_says_how_to_get_it(hf_home):
    if _has_modelscope():
        pytest.skip("modelscope is installed: the id would be fetched")
    error = _resolve_offline("iic/CosyVoice2-0.5B", hf_home)["error"]
    assert "cosystream[modelscope]" in error and "FunAudioLLM/CosyVoice2-0.5B" in error


def _has_modelscope() -> bool:
    import importlib.util

    return importlib.util.find_spec("modelscope") is not None


def test_a_directory_is_used_as_it_is(model_dir):
    assert resolve_model(model_dir) == model_dir
    assert resolve_model(str(model_dir)) == model_dir


def test_names_that_are_neither(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ModelNotFound, match="is a file"):
        resolve_model(tmp_path / "file.txt")
    with pytest.raises(ModelNotFound, match="not a model id"):
        resolve_model(tmp_path / "absent" / "deeper")
    assert is_model_id(DEFAULT_MODEL_ID) and is_model_id("iic/CosyVoice2-0.5B")
    assert not any(is_model_id(name) for name in ("/abs/path", "a/b/c", "./x", "name", "org/"))


def test_engine_from_pretrained_resolves_an_id_and_picks_the_device(monkeypatch, model_dir):
    import cosystream.engine.async_engine as async_engine

    seen = {}

    def fake_init(self, path, config):
        seen.update(path=path, device=config.device, dtype=config.dtype)

    monkeypatch.setattr(async_engine, "resolve_model", lambda name: model_dir if name == REPO_ID else None)
    monkeypatch.setattr(async_engine.AsyncEngine, "__init__", fake_init)
    async_engine.AsyncEngine.from_pretrained(REPO_ID)
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert seen == {"path": model_dir, "device": expected, "dtype": "bfloat16" if expected == "cuda" else "float32"}
