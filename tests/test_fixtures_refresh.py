"""tests/fixtures/refresh.py: the shipped fixture sets replaced file by file from a folder laid out the same way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REFRESH = Path(__file__).resolve().parent / "fixtures" / "refresh.py"


def _refresh_main():
    spec = importlib.util.spec_from_file_location("fixtures_refresh", REFRESH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_refresh_copies_sets_removes_what_the_source_dropped_and_keeps_other_sets(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    for name, text in {"README.md": "new readme", "materialize.py": "# new", "set_a/weights.json": "{}",
                       "set_a/manifest.json": "new", "set_a/model/cosyvoice2.yaml": "yaml",
                       "set_a/model/llm.pt": "materialised weights", "notes/other.txt": "not a set"}.items():
        _write(src / name, text)
    for name, text in {"README.md": "old readme", "set_a/weights.json": "{}", "set_a/manifest.json": "old",
                       "set_a/stale.json": "dropped upstream", "set_b/weights.json": "{}"}.items():
        _write(dst / name, text)
    main = _refresh_main()
    assert main([str(src), "--dst", str(dst), "--check"]) == 1  # differences, nothing written
    assert (dst / "set_a" / "manifest.json").read_text() == "old"
    assert main([str(src), "--dst", str(dst)]) == 0
    assert (dst / "README.md").read_text() == "new readme" and (dst / "materialize.py").read_text() == "# new"
    assert (dst / "set_a" / "manifest.json").read_text() == "new"
    assert (dst / "set_a" / "model" / "cosyvoice2.yaml").is_file()
    assert not (dst / "set_a" / "model" / "llm.pt").exists()  # materialize.py writes weights, never a copy
    assert not (dst / "set_a" / "stale.json").exists()
    assert (dst / "set_b" / "weights.json").is_file() and not (dst / "notes").exists()
    assert main([str(src), "--dst", str(dst), "--check"]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "notes"), "--dst", str(dst)]) == 2  # no set there
    assert "materialize.py" in capsys.readouterr().err
