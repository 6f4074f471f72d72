"""Lower layers never import higher ones (docs/architecture.md holds the same table)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cosystream"

# layer -> cosystream sub-packages/modules it must not import
FORBIDDEN = {
    "config": {"checkpoint", "frontend", "models", "engine", "server", "bench", "cli"},
    "params": {"checkpoint", "frontend", "models", "engine", "server", "bench", "cli"},
    "outputs": {"checkpoint", "frontend", "models", "engine", "server", "bench", "cli"},
    "errors": {"checkpoint", "frontend", "models", "engine", "server", "bench", "cli"},
    "cuda_graphs": {"checkpoint", "frontend", "models", "engine", "server", "bench", "cli"},
    "transfers": {"checkpoint", "frontend", "models", "engine", "server", "bench", "cli"},
    "checkpoint": {"frontend", "models", "engine", "server", "bench", "cli"},
    "frontend": {"models", "engine", "server", "bench", "cli"},
    # models hold the math as plain PyTorch: fused kernels are handed in by the engine, never imported
    "models": {"frontend", "kernels", "engine", "server", "bench", "cli"},
    "engine": {"server", "bench", "cli"},
    "kernels": {"checkpoint", "frontend", "models", "engine", "server", "bench", "cli"},
    "server": {"models", "frontend", "checkpoint", "bench"},
    "bench": {"engine", "models", "frontend", "checkpoint"},
    # Ray Serve around the server: each replica's engine process builds the engine and the server app
    "scale": {"models", "frontend", "checkpoint", "kernels", "bench", "cli"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def test_no_upward_imports():
    problems = []
    for path in PACKAGE.rglob("*.py"):
        layer = _layer(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "cosystream" or len(parts) < 2:
                continue
            target = parts[1]
            if target in FORBIDDEN.get(layer, set()):
                problems.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
            if layer == "models" and target == "checkpoint" and name != "cosystream.checkpoint.hparams":
                problems.append(f"{path.relative_to(PACKAGE.parent)}: models may read only checkpoint.hparams")
    assert not problems, "\n".join(problems)


def test_server_never_imports_torch():
    offenders = [str(p) for p in (PACKAGE / "server").rglob("*.py") if "torch" in {
        n.split(".")[0] for n in _imports(p)}]
    assert not offenders, offenders


def test_models_fork_no_streams_and_read_no_private_tensor_state():
    """models/ runs as plain PyTorch: side streams, prefetch and caches keyed by a tensor's in-place version
    belong to the engine, which applies them from outside (engine/flow_fast.py)."""
    banned = {"stream", "Stream", "wait_stream", "current_stream", "_version"}
    offenders = []
    for path in (PACKAGE / "models").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in banned:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} .{node.attr}")
    assert not offenders, offenders
