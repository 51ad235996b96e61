"""The HTTP endpoints next to the WebSocket one."""

from __future__ import annotations

import httpx

from seedance.engines.base import EngineHealth
from seedance.engines.synthetic import SyntheticEngine
from tests.support.servers import RunningServer


def test_healthz(server: RunningServer) -> None:
    response = httpx.get(f"{server.http_url}/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_models_lists_served_names(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[SyntheticEngine(name="alpha"), SyntheticEngine(name="beta")])
    body = httpx.get(f"{server.http_url}/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["alpha", "beta"]
    assert all(m["object"] == "model" and m["owned_by"] == "seedance" for m in body["data"])


def test_plain_http_on_the_websocket_path(server: RunningServer) -> None:
    response = httpx.get(f"{server.http_url}/v2/infer")
    assert response.status_code == 426
    assert response.json()["error"]["code"] == "upgrade_required"


class SickEngine(SyntheticEngine):
    def health(self) -> EngineHealth:
        return EngineHealth(ok=False, detail="device lost")


def test_unhealthy_engine_fails_healthz(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[SickEngine()])
    response = httpx.get(f"{server.http_url}/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy", "detail": "synthetic: device lost"}
