"""HTTP/WebSocket server over the async engine (FastAPI; no torch): see docs/server.md."""

from cosystream.server.app import build_app, serve
from cosystream.server.state import ServerSettings

__all__ = ["build_app", "serve", "ServerSettings"]
