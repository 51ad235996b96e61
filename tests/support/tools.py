"""The programs the tests run for real (Debian packages that ``.ci/run`` installs)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from typing import Any

import pytest


def tool(name: str, package: str) -> str:
    """The path of ``name``; the test is skipped when it is not installed."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {package}; .ci/run installs it)")
    return path


def wait_listening(
    proc: subprocess.Popen[Any], port: int, name: str, timeout_s: float = 10
) -> None:
    """Wait until ``proc`` accepts connections on 127.0.0.1:``port``; raise with its stderr if
    it exits or does not in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {proc.communicate()[1]!r}")
        time.sleep(0.05)
