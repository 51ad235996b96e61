"""The cluster mode across network partitions, on real links: a node in a network namespace of
its own (:class:`~seedance.testing.regions.Regions`: the edge), Redis in another (the far
side: one ``redis-server``, or a primary, a replica and three sentinels), the other node and the
clients in this one. Cutting the edge-far link cuts the node off
from Redis but not from its clients; taking the edge's own link down cuts it off from its
clients but not from Redis. The last test puts the primary on the edge too: the cut leaves it
with the node, away from its replicas and sentinels."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from seedance.cluster.link import RIDE_THROUGH_S
from tests.support.netns import EDGE_ADDRESS, EDGE_ON_LINK, FAR_ADDRESS, FAR_ON_LINK, Regions
from tests.support.redis import RedisServer, Sentinels
from tests.support.servers import ServerProcess
from tests.support.ws import recv_json
from tests.test_cluster import chat_until
from tests.test_resume import Reading, begin, read, read_whole, resume, undisturbed

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.timeout(240)]

LEASE_S = 1.0


def partitioned_cluster(
    tmp_path: Path, regions: Regions, store: str = "redis"
) -> tuple[RedisServer | Sentinels, ServerProcess, str, ServerProcess]:
    """Redis on the far side (``store``: ``redis``, one server; ``sentinels``, a primary, a
    replica and three sentinels); a node on the edge (its URL as this process reaches it) and
    one here, both at 300 tokens/s."""
    far = regions.exec(regions.far, [])
    redis: RedisServer | Sentinels
    if store == "sentinels":
        redis = Sentinels(tmp_path, host=FAR_ADDRESS, prefix=far).start()
        edge_redis = redis.url  # the edge reaches FAR_ADDRESS across the link
    else:
        redis = RedisServer(tmp_path, host=FAR_ADDRESS, prefix=far).start()
        edge_redis = f"redis://{FAR_ON_LINK}:{redis.port}/0"
    flags = ("--lease", str(LEASE_S), "--synthetic-tokens-per-s", "300")
    node = ServerProcess(
        "--host", "0.0.0.0", "--redis", edge_redis, "--node-id", "edge", *flags,
        prefix=regions.exec(regions.edge, []),
    )  # fmt: skip
    other = ServerProcess("--redis", redis.url, "--node-id", "here", *flags)
    return redis, node, f"ws://{EDGE_ADDRESS}:{node.port}", other


async def taken_over_then_healed(
    regions: Regions,
    node: ServerProcess,
    other: ServerProcess,
    reading: Reading,
    expected: str,
    tokens: int,
    healed: str,
) -> None:
    """The client of reply ``r1`` of session ``cut`` (``tokens`` long), given up by ``node``
    on the edge, resumes on ``other``, which takes the reply over: every seq once, to its
    end, the undisturbed text. Then the edge-far link comes back (``node`` logs ``healed``),
    and the log still holds that one reply."""
    resumed, _ = await resume(other, "cut", reading)  # type: ignore[arg-type]
    async with resumed:
        await read(resumed, reading)
    assert reading.end is not None and reading.end["type"] == "done"
    assert reading.last_seq == tokens - 1 and reading.text == expected
    await other.logged("request r1 taken over at seq")

    regions.link(True)
    await node.logged(healed, timeout_s=30)
    await asyncio.sleep(1)  # what the node might still send, sent
    whole = await read_whole(other, "cut")
    assert whole.text == expected and whole.end == reading.end


def stop_store(redis: RedisServer | Sentinels) -> None:
    if isinstance(redis, Sentinels):
        redis.stop()
    else:
        redis.stop(kill=True)


@pytest.mark.parametrize("store", ["redis", "sentinels"])
async def test_a_node_cut_off_from_redis_stops_and_its_reply_goes_on_elsewhere(
    tmp_path: Path, regions: Regions, store: str
) -> None:
    """The edge-far link cut under a reply: the cut-off node refuses new requests, gives its
    reply up within about a lease (behind sentinels: once a failover's wait is over, as the
    node cannot tell a cut from a failover), its reader is moved with 1001, the client resumes
    on the other node, which takes the reply over; once the link is back the cut-off node
    writes nothing: the log holds one reply, every seq once, the undisturbed text."""
    redis, node, node_url, other = partitioned_cluster(tmp_path, regions, store)
    waits_s = LEASE_S if store == "redis" else RIDE_THROUGH_S
    tokens = 1500 if store == "redis" else 5000  # 17 s at 300 tokens/s: past the wait
    try:
        expected = await undisturbed(other, max_tokens=tokens)  # type: ignore[arg-type]
        ws, reading = await begin(node_url, "cut", tokens, until_seq=50)
        regions.link(False)
        cut_at = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            while reading.end is None:  # the reply pauses, silent, while the node waits
                reading.take(await recv_json(ws, waits_s + 5))  # type: ignore[arg-type]
        gave_up_s = time.monotonic() - cut_at
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        assert gave_up_s < waits_s + 2, gave_up_s  # the wait, and a Redis timeout
        await node.logged("has not reached Redis for over")
        refused = await chat_until(f"http://{EDGE_ADDRESS}:{node.port}", 503)
        assert refused.status_code == 503 and "does not answer" in refused.text

        healed = "answers again"
        await taken_over_then_healed(regions, node, other, reading, expected, tokens, healed)
        assert (await chat_until(f"http://{EDGE_ADDRESS}:{node.port}", 200)).status_code == 200
    finally:
        for proc in (node, other):
            proc.stop()
        stop_store(redis)


async def test_a_node_cut_off_from_its_clients_lets_them_resume_elsewhere(
    tmp_path: Path, regions: Regions
) -> None:
    """The edge's own link down under a reply (the node still reaches Redis): the client,
    hearing nothing, resumes on the other node, which follows the reply as its node goes on
    writing it to Redis: every seq once, the undisturbed text."""
    redis, node, node_url, other = partitioned_cluster(tmp_path, regions)
    try:
        expected = await undisturbed(other, max_tokens=600)  # type: ignore[arg-type]
        ws, reading = await begin(node_url, "unreachable", 600, until_seq=50)
        regions.edge_reachable(False)
        with pytest.raises(asyncio.TimeoutError):
            while True:  # what was on its way, then silence
                reading.take(await asyncio.wait_for(recv_json(ws), 1.0))  # type: ignore[arg-type]
        resumed, hello = await resume(other, "unreachable", reading)  # type: ignore[arg-type]
        assert hello["active"]["state"] == "running"
        async with resumed:
            await read(resumed, reading)
        assert reading.end is not None and reading.end["type"] == "done"
        assert reading.last_seq == 599 and reading.text == expected
        assert "taken over" not in other.output  # its own node wrote it to the end
        regions.edge_reachable(True)
    finally:
        for proc in (node, other):
            proc.stop()
        stop_store(redis)


@contextlib.contextmanager
def primary_on_the_edge(tmp_path: Path, regions: Regions) -> Iterator[str]:
    """Redis's primary on the edge, two replicas and three sentinels on the far side (each
    replica known by its far address, which this namespace reaches without the link): the
    nodes' ``--redis`` URL."""
    route = ["ip", "-n", regions.far, "route", "add", f"{EDGE_ADDRESS}/32", "via", EDGE_ON_LINK]
    subprocess.run(route, check=True)
    redis = Sentinels(
        tmp_path, host=FAR_ADDRESS, prefix=regions.exec(regions.far, []), replicas=2,
        primary_host=EDGE_ADDRESS, primary_prefix=regions.exec(regions.edge, []),
    )  # fmt: skip
    try:
        yield redis.start().url
    finally:
        redis.stop()


async def test_a_primary_cut_off_with_a_node_loses_nothing_its_client_saw(
    tmp_path: Path, regions: Regions
) -> None:
    """``--redis-wait-strict``, the primary and a node on the edge: the edge-far link cut
    under a reply. The sentinels promote a replica; the old primary still answers the edge
    node, but no replica acknowledges its writes, so the node sends its client no token
    the new primary lacks, and gives the reply up past the failover's wait (1001). The client
    resumes on the other node, which takes the reply over from the new primary: every seq
    once, the undisturbed text. (Without ``--redis-wait-strict`` the edge node went on
    streaming to its client from writes only the old primary held.) Once the link is back
    the old primary follows the new one, and the log holds the one reply."""
    with primary_on_the_edge(tmp_path, regions) as url:
        flags = ("--redis", url, "--redis-wait-strict", "--lease", str(LEASE_S))
        flags += ("--synthetic-tokens-per-s", "300")
        node = ServerProcess(
            "--host", "0.0.0.0", "--node-id", "edge", *flags,
            prefix=regions.exec(regions.edge, []),
        )  # fmt: skip
        other = ServerProcess("--node-id", "here", *flags)
        try:
            expected = await undisturbed(other, max_tokens=5000)  # type: ignore[arg-type]
            node_url = f"ws://{EDGE_ADDRESS}:{node.port}"
            ws, reading = await begin(node_url, "cut", 5000, until_seq=50)
            regions.link(False)
            with pytest.raises(ConnectionClosed) as closed:
                while reading.end is None:
                    reading.take(await recv_json(ws, RIDE_THROUGH_S + 5))  # type: ignore[arg-type]
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            await node.logged("replica(s) acknowledged a write")

            healed = "answers again (another server: a failover)"
            await taken_over_then_healed(regions, node, other, reading, expected, 5000, healed)
        finally:
            for proc in (node, other):
                proc.stop()
