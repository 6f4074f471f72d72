"""Import the scripts of benchmarks/ in tests (they are not a package: each runs with its folder on sys.path)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, its folder on sys.path only while it imports (as when it runs)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
