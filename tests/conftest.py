"""Fixtures: a real server on a real socket, in a thread of this process or as a subprocess
(the servers themselves are in tests/support/servers.py)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from seedance.engines.base import Engine
from seedance.observability.tracing import Tracing
from tests.support.certs import write_key_pair
from tests.support.netns import Regions, need_namespaces
from tests.support.redis import RedisServer
from tests.support.servers import THREADS, RunningServer, ServerProcess, server_config

# The llamacpp engine caches its CPU probe's decision (--repack auto) here, not in the user's
# cache; servers started by the tests, in process or not, share it.
os.environ.setdefault("SEEDANCE_CACHE_DIR", tempfile.mkdtemp(prefix="seedance-tests-"))
# ``seedance serve`` subprocesses use this test process's share of the cores, as in-process
# servers do (tests/support/servers.py: THREADS).
os.environ["SEEDANCE_THREADS"] = str(THREADS)


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
    """``make_server(engines=None, tracing=None, **config_fields)`` starts a server; stopped
    at teardown."""
    servers: list[RunningServer] = []

    def factory(
        engines: Sequence[Engine] | None = None, tracing: Tracing | None = None, **fields: Any
    ) -> RunningServer:
        fields.setdefault("engine", "synthetic")  # the default engine loads a real model
        server = RunningServer(server_config(**fields), engines, tracing).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture
def server(make_server: Callable[..., RunningServer]) -> RunningServer:
    """A default server on the synthetic engine (unlimited token rate)."""
    return make_server()


@pytest.fixture(scope="session")
def transformers_server() -> Iterator[RunningServer]:
    """The transformers engine on the embedded GGUF, 4 rows of 1,024 tokens on the CPU: it
    takes seconds to load, so the conformance suite and test_transformers.py share one."""
    server = RunningServer(
        server_config(engine="transformers", device="cpu", parallel=4, n_ctx=4 * 1024), None
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm() -> Iterator[RunningServer]:
    """The embedded model on llama.cpp, two sequences of 2,048 tokens, for a module's tests."""
    server = RunningServer(server_config(engine="llamacpp", parallel=2, n_ctx=4096), None).start()
    yield server
    server.stop()


@pytest.fixture
def regions() -> Iterator[Regions]:
    """Two network namespaces and their links (skipped where they cannot be made)."""
    need_namespaces()
    made = Regions()
    yield made
    made.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` of the test's own (skipped where it is not installed)."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop(kill=True)


@pytest.fixture
def server_process() -> Iterator[Callable[..., ServerProcess]]:
    procs: list[ServerProcess] = []

    def factory(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> ServerProcess:
        proc = ServerProcess(*args, env=env, **kwargs)
        procs.append(proc)
        return proc

    yield factory
    for proc in procs:
        proc.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts ``seedance serve`` through the fixture is a ``subprocess`` test
    (other markers are set where the tests are written)."""
    for item in items:
        if "server_process" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.subprocess)


#: How a test says it was skipped for want of a program (tests/support/tools.py).
_MISSING = re.compile(r"\(Debian package ([\w.+-]+);")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say what was skipped for want of a program, and the one command that installs them
    all (a fresh machine has only Python: ``.ci/run`` installs the rest as root)."""
    packages: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        found = _MISSING.search(reason)
        if found:
            packages[found.group(1)] = packages.get(found.group(1), 0) + 1
    if not packages:
        return
    skipped = sum(packages.values())
    names = " ".join(sorted(packages))
    write = terminalreporter.write_line
    terminalreporter.section("skipped for want of a program", sep="-")
    for package, count in sorted(packages.items()):
        write(f"  {count:3d} test(s): Debian package {package} is not installed")
    write(f"  {skipped} test(s) in all; to run them: sudo apt-get install {names}")
    write("  (or run .ci/run as root: it installs every package the tests need, then make test)")


@pytest.fixture
def identity(tmp_path: Path) -> tuple[str, str]:
    """An end-to-end encryption identity: (private key PEM path, public key PEM path)."""
    private, public = tmp_path / "identity.pem", tmp_path / "identity.pub.pem"
    write_key_pair(Ed25519PrivateKey.generate(), private, public)
    return str(private), str(public)


@pytest.fixture(scope="session")
def reference() -> Any:
    """sentence-transformers on the packaged all-MiniLM-L6-v2: what the embedding model's
    vectors and tokens are checked against."""
    from sentence_transformers import SentenceTransformer

    from seedance.engines.embeddings import model_folder

    folder, _ = model_folder("all-minilm-l6-v2")
    return SentenceTransformer(str(folder), device="cpu")
