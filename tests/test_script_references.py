"""Every benchmark script the package, the docs and the benchmarks name exists, or the mention says where in
git's history to find it (a retired script's numbers stay quoted beside the code they tuned)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MENTION = re.compile(r"benchmarks/[A-Za-z0-9_]+\.(?:py|sh)")
NEAR = 200  # characters either side of a mention that may carry its `git show <rev>^:benchmarks/...`


def _sources() -> list[Path]:
    files = [*ROOT.glob("cosystream/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    files += [p for p in ROOT.glob("benchmarks/*") if p.suffix in (".py", ".sh")]
    return sorted(p for p in files if p.is_file())


def _dangling(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    out = []
    for match in MENTION.finditer(text):
        if (ROOT / match.group()).exists():
            continue
        window = text[max(0, match.start() - NEAR):match.end() + NEAR]
        if not re.search(r"git\s+show\s+\S+\^:" + re.escape(match.group()), window):
            line = text.count("\n", 0, match.start()) + 1
            out.append(f"{path.relative_to(ROOT)}:{line}: {match.group()}")
    return out


def test_named_benchmark_scripts_exist_or_point_into_git_history():
    sources = _sources()
    assert len(sources) > 50  # the package, the docs and the benchmarks were found
    dangling = [d for path in sources for d in _dangling(path)]
    assert dangling == [], "scripts named but missing (restore them, or name the commit that has them):\n" + \
        "\n".join(dangling)


def test_a_missing_script_without_its_history_is_reported(tmp_path, monkeypatch):
    doc = tmp_path / "note.md"
    doc.write_text("tuned with benchmarks/no_such_script.py\n\nand benchmarks/gone.py "
                   "(`git show abc123^:benchmarks/gone.py`)\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert _dangling(doc) == ["note.md:1: benchmarks/no_such_script.py"]
