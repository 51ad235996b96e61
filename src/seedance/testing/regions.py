"""Regions on one machine: Linux network namespaces, made and removed by their user (root,
``iproute2``), joined by veth pairs and by a link with delay and loss between them.

:class:`Regions` makes two namespaces, ``edge`` and ``far``, and three links::

    this process (10.70.1.1) --- edge (10.70.1.2)          veth, clean
    this process (10.70.2.1) --- far  (10.70.2.2)          veth, clean (to compare with direct)
    edge (10.70.3.1) ========== far (10.70.3.2)            the "long-distance" link

The edge reaches the far side's own address (10.70.2.2) across the long-distance link too, as
it would a server in another region; this process reaches it directly.

The long-distance link is :mod:`seedance.testing.wire`: ``tc netem``'s delay and loss on IP
packets, done in user space over TUN devices, because the kernels this project runs on
(Firecracker's) are built without ``sch_netem``. A program runs in a namespace with
:meth:`Regions.exec` (``ip netns exec``). Only the caller's own namespaces and devices are
touched (tests/test_relay_netns.py and suite 20 of ``make bench``).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence

EDGE_ADDRESS = "10.70.1.2"
FAR_ADDRESS = "10.70.2.2"
FAR_ON_LINK = "10.70.3.2"  # the far gateway as the edge sees it, across the lossy link
EDGE_ON_LINK = "10.70.3.1"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None and shutil.which("ip", path="/usr/sbin:/sbin") is None:
        return "ip is missing (Debian package iproute2; .ci/run installs it)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun: the long-distance link is a pair of TUN devices"
    probe = f"sdprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot make a network namespace: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


#: Held while a :class:`Regions` exists: their addresses are fixed, so one at a time on a
#: machine (tests in several processes wait for each other).
LOCK_FILE = "/tmp/seedance-regions.lock"


def _sweep() -> None:
    """Remove what a run that was killed left (its namespaces, their veth pairs with them): with
    the lock held, any namespace of ours is stale."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith("sd-") and name.endswith(("-edge", "-far")):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Regions:
    """The namespaces and links (see the module); :meth:`close` removes them."""

    def __init__(self) -> None:
        self._lock = open(LOCK_FILE, "w")  # noqa: SIM115  # held until close()
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        _sweep()
        tag = secrets.token_hex(3)
        self.edge = f"sd-{tag}-edge"
        self.far = f"sd-{tag}-far"
        self._devices: list[str] = []  # the root side of each pair (deleting it deletes both)
        try:
            for ns in (self.edge, self.far):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            self._pair(f"sd{tag}e", None, "10.70.1.1", self.edge, EDGE_ADDRESS)
            self._pair(f"sd{tag}f", None, "10.70.2.1", self.far, FAR_ADDRESS)
            self._wire = subprocess.Popen(
                [sys.executable, "-m", "seedance.testing.wire", self.edge,
                 f"{EDGE_ON_LINK}/24", self.far, f"{FAR_ON_LINK}/24"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            self._answer()  # "ready"
            _ip("-n", self.edge, "route", "add", f"{FAR_ADDRESS}/32", "via", FAR_ON_LINK)
        except BaseException:
            self.close()
            raise

    def _tell(self, command: str) -> str:
        assert self._wire.stdin is not None
        self._wire.stdin.write(command + "\n")
        self._wire.stdin.flush()
        answer = self._answer()
        if answer.startswith("error"):
            raise RuntimeError(f"the wire: {command}: {answer}")
        return answer

    def carried(self) -> tuple[int, int]:
        """IP bytes the edge-far link carried so far: edge to far, far to edge."""
        _, to_far, to_edge = self._tell("bytes").split()
        return int(to_far), int(to_edge)

    def _answer(self) -> str:
        assert self._wire.stdout is not None
        line = self._wire.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the wire ended (exit {self._wire.wait()})")
        return line

    def _pair(self, name: str, left_ns: None, left: str, right_ns: str, right: str) -> None:
        """A veth pair from this namespace (``left``) to ``right_ns`` (``right``)."""
        a, b = f"{name}0", f"{name}1"
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        self._devices.append(a)
        _ip("link", "set", b, "netns", right_ns)
        _ip("-n", right_ns, "addr", "add", f"{right}/24", "dev", b)
        _ip("-n", right_ns, "link", "set", b, "up")
        _ip("addr", "add", f"{left}/24", "dev", a)
        _ip("link", "set", a, "up")

    def netem(self, delay_ms: float, loss_pct: float = 0.0) -> None:
        """Each direction of the edge-far link delayed by ``delay_ms`` (the round trip: twice
        it) and losing ``loss_pct`` % of its packets."""
        self._tell(f"delay {delay_ms}")
        self._tell(f"loss {loss_pct}")

    def link(self, up: bool) -> None:
        """The edge-far link up or down (a cut cable)."""
        self._tell("up" if up else "down")

    def edge_reachable(self, up: bool) -> None:
        """The clean link between this process and the edge up or down (the edge cut off
        from its clients, while its link to the far side holds)."""
        _ip("link", "set", self._devices[0], "up" if up else "down")

    def exec(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run in namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        wire = getattr(self, "_wire", None)
        if wire is not None:
            wire.kill()
            wire.wait()
        for device in self._devices:
            subprocess.run(["ip", "link", "del", device], capture_output=True)
        for ns in (self.edge, self.far):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
