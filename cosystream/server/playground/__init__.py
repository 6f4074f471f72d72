"""The web playground: static files served by `cosystream serve` at `/` (off with `--no-playground`).

    GET /                     index.html
    GET /playground/<file>    its scripts and style sheet

Plain HTML, CSS and ES modules from this package directory, no build step and nothing fetched from
elsewhere. The page itself is public (the paths are added to the auth-exempt list); every API call it
makes carries the API key the user types in, so the access rules of the API are unchanged.
docs/playground.md describes the page.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, FastAPI, Response

ASSET_PREFIX = "/playground/"
INDEX = "index.html"
_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Same-origin only: the page loads nothing from elsewhere and talks only to the server that served it.
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # revalidate: a server upgrade must not pair a new page with old scripts
}


def asset_files() -> dict[str, bytes]:
    """Every servable file of this directory by name (python sources excluded)."""
    folder = resources.files(__package__)
    return {entry.name: entry.read_bytes() for entry in folder.iterdir()
            if entry.is_file() and _suffix(entry.name) in _MEDIA_TYPES}


def public_paths(files: dict[str, bytes]) -> tuple[str, ...]:
    """The URL paths the playground answers: `/` and one per asset."""
    return ("/", *(ASSET_PREFIX + name for name in sorted(files) if name != INDEX))


def install_playground(app: FastAPI, files: dict[str, bytes]) -> None:
    """Add GET routes for `/` and every asset, kept out of the OpenAPI schema (they are no API)."""
    if INDEX not in files:  # a broken install: say so at start, not with a 404 at the first visit
        raise FileNotFoundError(f"{INDEX} of the web playground is missing from the cosystream package "
                                "(reinstall it, or serve with --no-playground)")
    router = APIRouter(include_in_schema=False)
    for path in public_paths(files):
        name = INDEX if path == "/" else path[len(ASSET_PREFIX):]
        router.add_api_route(path, _file_endpoint(files[name], _MEDIA_TYPES[_suffix(name)]), methods=["GET", "HEAD"])
    app.include_router(router)


def _file_endpoint(content: bytes, media_type: str):
    async def serve_file() -> Response:
        return Response(content, media_type=media_type, headers=_SECURITY_HEADERS)

    return serve_file


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""
