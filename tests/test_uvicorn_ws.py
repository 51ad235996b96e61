"""The uvicorn internals that ``seedance.server.uvicorn_ws``, ``seedance.server.handshake`` and
``seedance.server.runner`` reach into, named one by one.

Those two modules subclass uvicorn's protocols and use attributes and methods uvicorn does not
promise to keep. pyproject.toml pins uvicorn to the releases this suite passed with; a release
that renames or drops one of them fails here with the name and the module that uses it, before
any test over a socket fails in a way that is harder to read.
"""

from __future__ import annotations

import inspect
import re
from importlib.metadata import version

import pytest
import uvicorn
from uvicorn import Server
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.server import ServerProtocol

#: Attributes of WebSocketsSansIOProtocol that uvicorn_ws reads or sets.
WS_ATTRIBUTES = [
    "app",
    "config",
    "loop",
    "transport",
    "client",
    "scope",
    "queue",
    "conn",
    "frames",
    "curr_msg_data_type",
    "handshake_initiated",
    "handshake_complete",
    "close_sent",
    "disconnected",
    "request",
    "response",
]
#: Its methods that uvicorn_ws overrides or calls, with their parameters after ``self``.
WS_METHODS = {
    "connection_made": ["transport"],
    "data_received": ["data"],
    "shutdown": [],
    "handle_connect": ["event"],
    "handle_ping": [],
    "handle_pong": ["event"],
    "handle_parser_exception": [],
    "send_receive_event_to_app": [],
    "send": ["message"],
}
#: H11Protocol's, for handshake.py.
HTTP_ATTRIBUTES = ["app", "transport", "client", "conn", "connections"]
HTTP_METHODS = {
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
}
#: uvicorn.Server's, for runner.py (its main loop wakes when should_exit is set).
SERVER_ATTRIBUTES = [
    "config",
    "should_exit",
    "force_exit",
    "servers",
    "started",
    "server_state",
    "lifespan",
]
SERVER_METHODS = {
    "main_loop": [],
    "on_tick": ["counter"],
    "_wait_tasks_to_complete": [],
    "startup": ["sockets"],
    "shutdown": ["sockets"],
    "handle_exit": ["sig", "frame"],
}

#: uvicorn.Config's, for runner.py (it serves TLS with a context of its own: ``ssl``).
CONFIG_ATTRIBUTES = ["ssl"]
CONFIG_METHODS: dict[str, list[str]] = {"load": []}


def _assigned(cls: type, name: str) -> bool:
    source = inspect.getsource(cls)
    return re.search(rf"self\.{name}\s*(:[^=\n]*)?=", source) is not None


@pytest.mark.parametrize(
    ("cls", "attributes", "user"),
    [
        (WebSocketsSansIOProtocol, WS_ATTRIBUTES, "seedance/server/uvicorn_ws.py"),
        (H11Protocol, HTTP_ATTRIBUTES, "seedance/server/handshake.py"),
        (Server, SERVER_ATTRIBUTES, "seedance/server/runner.py"),
        (uvicorn.Config, CONFIG_ATTRIBUTES, "seedance/server/runner.py"),
    ],
)
def test_the_attributes_are_there(cls: type, attributes: list[str], user: str) -> None:
    missing = [name for name in attributes if not _assigned(cls, name)]
    assert not missing, (
        f"uvicorn {uvicorn.__version__}'s {cls.__name__} no longer sets {missing}, which "
        f"{user} uses: adapt it, or keep uvicorn at the releases pinned in pyproject.toml"
    )


@pytest.mark.parametrize(
    ("cls", "methods", "user"),
    [
        (WebSocketsSansIOProtocol, WS_METHODS, "seedance/server/uvicorn_ws.py"),
        (H11Protocol, HTTP_METHODS, "seedance/server/handshake.py"),
        (Server, SERVER_METHODS, "seedance/server/runner.py"),
        (uvicorn.Config, CONFIG_METHODS, "seedance/server/runner.py"),
    ],
)
def test_the_methods_are_there(cls: type, methods: dict[str, list[str]], user: str) -> None:
    for name, parameters in methods.items():
        method = getattr(cls, name, None)
        assert callable(method), f"uvicorn {uvicorn.__version__}: {cls.__name__}.{name} is gone"
        found = list(inspect.signature(method).parameters)[1:]
        assert found == parameters, (
            f"uvicorn {uvicorn.__version__}: {cls.__name__}.{name} takes {found}, not "
            f"{parameters} as {user} expects"
        )


def test_the_websockets_connection_has_what_uvicorn_ws_reads() -> None:
    """uvicorn's ``conn`` is websockets' sans-I/O ServerProtocol (public API there)."""
    conn = ServerProtocol()
    for name in ("state", "handshake_exc", "parser_exc"):
        assert hasattr(conn, name), f"websockets {version('websockets')}: no {name}"
