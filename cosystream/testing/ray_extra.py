"""The optional `ray` extra in tests: its modules, or the test module skipped where the extra is not installed.
CI installs it, so there a missing Ray fails instead of skipping."""

from __future__ import annotations

import os
from typing import Any


def import_ray_or_skip() -> tuple[Any, Any]:
    """(ray, ray.serve), imported; without them the calling test module is skipped (an error under CI=true)."""
    import pytest

    try:
        import ray
        from ray import serve
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip("ray[serve] is not installed (pip install cosystream[ray])", allow_module_level=True)
    return ray, serve
