"""The playground's HTTP side, without a browser: what `/` serves, that it is public while the API keeps its
key, that `--no-playground` removes it, that the package ships every file, and GET /v1/speakers.

The page itself is driven in a real browser by test_playground_browser.py.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from fake_engine import FakeEngine, fake_server
from test_errors import assert_error

from cosystream.cli import build_parser
from cosystream.server import playground
from cosystream.server.cli import settings_from_args
from cosystream.server.state import ServerSettings

KEY = "sk-playground"
REPO = Path(__file__).resolve().parents[2]


def referenced_assets(html: str) -> list[str]:
    """Every same-origin script and style sheet index.html loads, and the modules app.js imports."""
    paths = re.findall(r'(?:src|href)="(/playground/[^"]+)"', html)
    app_js = (Path(playground.__file__).parent / "app.js").read_text()
    paths += ["/playground/" + name for name in re.findall(r'from "\./([^"]+)"', app_js)]
    return paths


def test_root_serves_the_page_and_every_file_it_loads():
    with fake_server(ServerSettings()) as server, server.client() as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assets = referenced_assets(page.text)
        assert {"/playground/app.js", "/playground/style.css", "/playground/player.js"} <= set(assets)
        for path in assets:
            response = client.get(path)
            assert response.status_code == 200, path
            expected = "text/css" if path.endswith(".css") else "text/javascript"
            assert response.headers["content-type"].startswith(expected), path
            assert response.content == (Path(playground.__file__).parent / Path(path).name).read_bytes()
        assert client.head("/").status_code == 200
        assert_error(client.get("/playground/__init__.py"), 404, "not_found")  # only the page's own files
        assert "/" not in client.get("/openapi.json").json()["paths"]  # the page is no API operation


def test_no_playground_leaves_root_unrouted():
    with fake_server(ServerSettings(playground=False)) as server, server.client() as client:
        assert_error(client.get("/"), 404, "not_found")
        assert_error(client.get("/playground/app.js"), 404, "not_found")
    args = build_parser().parse_args(["serve", "--model-dir", "m", "--no-playground"])
    assert settings_from_args(args, environ={}).playground is False
    assert settings_from_args(build_parser().parse_args(["serve", "--model-dir", "m"]), environ={}).playground


def test_the_page_is_public_while_the_api_keeps_needing_the_key():
    with fake_server(ServerSettings(api_keys=frozenset({KEY}))) as server, server.client() as client:
        page = client.get("/")
        assert page.status_code == 200
        for path in referenced_assets(page.text):
            assert client.get(path).status_code == 200, path
        assert_error(client.get("/v1/voices"), 401, "unauthorized", "Authorization")
        assert_error(client.get("/v1/speakers"), 401, "unauthorized", "Authorization")
        assert_error(client.get("/metrics"), 401, "unauthorized", "Authorization")
        assert client.get("/v1/voices", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert_error(client.get("/nothing"), 401, "unauthorized", "Authorization")  # only the page's own paths


def test_cors_settings_are_unchanged_by_the_playground():
    origin = "https://app.example.com"
    with fake_server(ServerSettings(cors_origins=(origin,))) as server, server.client() as client:
        allowed = client.get("/v1/voices", headers={"Origin": origin})
        assert allowed.headers["access-control-allow-origin"] == origin
        other = client.get("/v1/voices", headers={"Origin": "https://elsewhere.example.com"})
        assert "access-control-allow-origin" not in other.headers


def test_speakers_lists_the_models_built_in_speakers():
    class Entry:
        def __init__(self, prompt: object) -> None:
            self.prompt = prompt

    engine = FakeEngine()
    with fake_server(ServerSettings(), engine) as server, server.client() as client:
        assert client.get("/v1/speakers").json() == {"speakers": []}  # an engine without spk2info: no sft
        engine.frontend = type("Frontend", (), {"speakers": {"zh_f": Entry(None), "en_m": Entry(object())}})()
        assert client.get("/v1/speakers").json() == {"speakers": [{"name": "en_m", "zero_shot": True},
                                                                  {"name": "zh_f", "zero_shot": False}]}


def test_the_package_ships_every_playground_file():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["cosystream"]
    files = playground.asset_files()
    assert "index.html" in files and "app.js" in files
    for name in files:
        assert any(fnmatch.fnmatch(f"server/playground/{name}", p) for p in patterns), name
