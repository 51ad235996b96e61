"""The relay across a real, lossy link: an edge and a far gateway in network namespaces of
their own, joined by a veth pair with ``tc netem`` delay and loss (tests/support/netns.py),
each a ``seedance serve`` process in its namespace. What crosses the "regions" crosses that
link: the reply is the far gateway's own, token for token, at 80 ms of round trip with 2% of
packets lost, and a reply goes on whole across a cut of the cable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from seedance.client import connect
from tests.support.netns import EDGE_ADDRESS, FAR_ADDRESS, FAR_ON_LINK, Regions
from tests.support.servers import TEST_WORKERS, ServerProcess

pytest.importorskip("aioquic", reason="the relay needs aioquic, which needs Python 3.11")

from tests.support.relay import Region

pytestmark = pytest.mark.subprocess


def start(
    server_process: Callable[..., ServerProcess], regions: Regions, region: Region, *far: str
) -> tuple[ServerProcess, ServerProcess]:
    """The far gateway (``far`` flags added) and an edge relaying to it across the link."""
    far_server = server_process(
        "--host", "0.0.0.0", *region.far_flags(), *far, prefix=regions.exec(regions.far, [])
    )
    far_url = f"https://{FAR_ON_LINK}:{far_server.port}"
    edge = server_process(
        "--host", "0.0.0.0", *region.edge_flags(far_url), prefix=regions.exec(regions.edge, [])
    )
    return far_server, edge


async def test_a_reply_relayed_across_a_lossy_link_is_the_far_gateways_own(
    server_process: Callable[..., ServerProcess], regions: Regions, tmp_path: Path
) -> None:
    regions.netem(delay_ms=40, loss_pct=2)
    region = Region(tmp_path, far_addresses=(FAR_ON_LINK, FAR_ADDRESS))
    far, edge = start(server_process, regions, region)
    await far.logged("HTTP/3 and WebTransport on UDP port")
    ca = str(region.authority.pem)
    prompts = [f"question {i}" for i in range(4)]

    async def ask(url: str, prompt: str, **options: str) -> str:
        async with connect(url, **options) as session:  # a session each: no shared history
            return (await session.complete(prompt, max_tokens=40)).text

    direct = f"wss://{FAR_ADDRESS}:{far.port}"
    expected = [await ask(direct, p, ca_file=ca) for p in prompts]
    edge_url = f"ws://{EDGE_ADDRESS}:{edge.port}"
    got = await asyncio.gather(*(ask(edge_url, p) for p in prompts))  # at once, on one link
    assert got == expected
    # One QUIC connection for all of them, each worker's own under SEEDANCE_TEST_WORKERS.
    assert 1 <= edge.output.count("relay link to") <= int(TEST_WORKERS or 1)


async def test_a_reply_goes_on_whole_across_a_cut_of_the_cable(
    server_process: Callable[..., ServerProcess], regions: Regions, tmp_path: Path
) -> None:
    regions.netem(delay_ms=40)
    region = Region(tmp_path, far_addresses=(FAR_ON_LINK, FAR_ADDRESS))
    far, edge = start(server_process, regions, region, "--synthetic-tokens-per-s", "40")
    await far.logged("HTTP/3 and WebTransport on UDP port")
    async with connect(f"ws://{EDGE_ADDRESS}:{edge.port}") as session:
        reply = session.generate("through the storm", max_tokens=120)
        pieces: list[str] = []
        async for chunk in reply:
            pieces.append(chunk.text)
            if len(pieces) == 10:
                regions.link(up=False)  # 2 s without a cable, mid-reply
                asyncio.get_running_loop().call_later(2.0, regions.link, True)
        done = reply.done
    assert done is not None and done.finish_reason == "length"
    assert done.usage.completion_tokens == 120
    ca = str(region.authority.pem)
    async with connect(f"wss://{FAR_ADDRESS}:{far.port}", ca_file=ca) as direct:
        assert "".join(pieces) == (await direct.complete("through the storm", max_tokens=120)).text
