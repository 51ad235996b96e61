"""The server: ASGI app, connection loop, admission, transport and runner."""

from seedance.server.app import create_app

__all__ = ["create_app"]
