"""A link between two network namespaces that delays and drops IP packets: ``tc netem``'s job,
done in user space over TUN devices, for kernels built without ``sch_netem`` (Firecracker's,
which CI and this project's machines run).

``python -m seedance.testing.wire NS_A ADDRESS_A NS_B ADDRESS_B`` (as root) makes a TUN device
in each namespace (``ADDRESS`` in CIDR, ``10.70.3.1/24``), and carries every packet one sends
to the other after the delay, unless it is lost. Both TCP and UDP see a real lossy path: what a
packet loses is lost for the transport above, which must send it again. Commands on stdin, one
a line, change the link while it runs (each answered ``ok`` on stdout)::

    delay MS        each direction delayed by MS milliseconds (the round trip: twice it)
    loss PERCENT    each packet lost with this probability, in each direction
    down / up       the cable cut, or back
    bytes           the IP bytes carried so far, A to B and B to A (answered ``bytes N M``)

Packets leave in the order they came (a queue per direction); the link has no bandwidth limit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import fcntl
import os
import random
import struct
import subprocess
import sys
from typing import Final

_TUNSETIFF: Final = 0x400454CA
_IFF_TUN: Final = 0x0001
_IFF_NO_PI: Final = 0x1000
_CLONE_NEWNET: Final = 0x40000000
_MTU: Final = 1500


def _enter(namespace: str) -> None:
    """This process into network namespace ``namespace`` (``ip netns``'s)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {namespace}")
    finally:
        os.close(fd)


def _tun(namespace: str, name: str, address: str) -> int:
    """A TUN device ``name`` in ``namespace`` with ``address``, up; its file descriptor."""
    _enter(namespace)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    subprocess.run(["ip", "addr", "add", address, "dev", name], check=True)
    subprocess.run(["ip", "link", "set", name, "mtu", str(_MTU), "up"], check=True)
    return fd


class _Direction:
    """Packets from one device to the other: held ``delay`` seconds, some lost."""

    def __init__(self, link: Wire, source: int, target: int) -> None:
        self.link = link
        self.source = source
        self.target = target
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.timer: asyncio.TimerHandle | None = None
        self.carried = 0  # IP bytes delivered

    def readable(self) -> None:
        loop = asyncio.get_running_loop()
        link = self.link
        while True:
            try:
                packet = os.read(self.source, 65535)
            except BlockingIOError:
                return
            if link.down or random.random() < link.loss:
                continue
            self.queue.append((loop.time() + link.delay_s, packet))
            if self.timer is None:
                self.timer = loop.call_at(self.queue[0][0], self.release)

    def release(self) -> None:
        loop = asyncio.get_running_loop()
        self.timer = None
        now = loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, packet = self.queue.popleft()
            with contextlib.suppress(OSError):  # the device's queue is full: lost, as on a wire
                os.write(self.target, packet)
                self.carried += len(packet)
        if self.queue:
            self.timer = loop.call_at(self.queue[0][0], self.release)


class Wire:
    def __init__(self) -> None:
        self.delay_s = 0.0
        self.loss = 0.0
        self.down = False
        self.directions: list[_Direction] = []

    def command(self, line: str) -> str:
        word, _, value = line.strip().partition(" ")
        if word == "delay":
            self.delay_s = float(value) / 1000
        elif word == "loss":
            self.loss = float(value) / 100
        elif word in ("down", "up"):
            self.down = word == "down"
        elif word == "bytes":
            return "bytes " + " ".join(str(d.carried) for d in self.directions)
        else:
            return f"error: unknown command {line.strip()!r}"
        return "ok"


async def _serve(ns_a: str, address_a: str, ns_b: str, address_b: str) -> None:
    a = _tun(ns_a, "sdwire0", address_a)
    b = _tun(ns_b, "sdwire1", address_b)
    wire = Wire()
    loop = asyncio.get_running_loop()
    wire.directions = [_Direction(wire, a, b), _Direction(wire, b, a)]
    for fd, direction in zip((a, b), wire.directions, strict=True):
        loop.add_reader(fd, direction.readable)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := (await reader.readline()).decode():
        print(wire.command(line), flush=True)


def main() -> None:
    ns_a, address_a, ns_b, address_b = sys.argv[1:5]
    asyncio.run(_serve(ns_a, address_a, ns_b, address_b))


if __name__ == "__main__":
    main()
