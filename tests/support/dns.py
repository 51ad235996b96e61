"""A DNS server of the test's own: Debian's ``dnsmasq`` on 127.0.0.1, answering A records
from a hosts file that the test rewrites (a headless Service's name and its pods' addresses,
as Kubernetes' DNS serves them)."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

from seedance.netutil import free_port
from tests.support.tools import tool
from tests.support.waits import wait_for


class Dns:
    """``dnsmasq`` on 127.0.0.1:``port``, authoritative for the names :meth:`serve` gives."""

    def __init__(self, directory: Path) -> None:
        binary = tool("dnsmasq", "dnsmasq-base")
        self.hosts = directory / "hosts"
        self.hosts.write_text("")
        self.port = free_port()
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [binary, "--keep-in-foreground", "--log-facility=-", "--conf-file=/dev/null",
             "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}", "--local-ttl=0",
             "--listen-address=127.0.0.1", "--bind-interfaces", f"--port={self.port}",
             "--user=root", "--pid-file="],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_read()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def _reads(self) -> int:
        return sum(1 for line in self.lines if f"read {self.hosts}" in line)

    def _wait_read(self, before: int = 0) -> None:
        """Until dnsmasq has read the hosts file once more than ``before`` times."""
        wait_for(lambda: self._reads() > before, f"dnsmasq reading {self.hosts}", 10)

    def serve(self, name: str, addresses: list[str]) -> None:
        """``name`` resolves to ``addresses`` from now on (dnsmasq reads the file again on
        SIGHUP)."""
        before = self._reads()
        self.hosts.write_text("".join(f"{address} {name}\n" for address in addresses))
        self.proc.send_signal(signal.SIGHUP)
        self._wait_read(before)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
