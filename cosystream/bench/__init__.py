"""Load generator for a running server (HTTP / WebSocket / OpenAI-compatible) and the shared report code.

A black box: imports only leaf modules and talks to the server over the network (docs/architecture.md).
"""
