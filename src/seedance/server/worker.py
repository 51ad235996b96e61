"""A worker process of ``seedance serve --workers N``: ``python -m seedance.server.worker``,
started by the supervisor (:mod:`seedance.server.workers`)."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from seedance import children
from seedance.config import ConfigError, ServerConfig

if TYPE_CHECKING:
    from seedance.engines.base import Engine
from seedance.server.siblings import bind_shared

logger = logging.getLogger("seedance")


def main() -> int:
    """A worker process's entry point."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # Until the server is built, the supervisor's stop (SIGUSR1) is an exit: nothing is served
    # yet. (One that came before this line is also on the input, read once the server runs.)
    # A SIGINT or SIGTERM to the whole group is the supervisor's to pass on.
    signal.signal(signal.SIGUSR1, lambda sig, frame: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config: ServerConfig
    engines: list[Engine] | None
    config, engines = children.read_setup()
    assert config.worker is not None
    # The supervisor is the server: killed (kill -9, the OOM killer), the workers go with it.
    children.die_with_parent(config.worker.supervisor)
    from seedance.observability.logs import configure_logging
    from seedance.server.app import create_app
    from seedance.server.runner import build_server, raise_descriptors

    configure_logging(config.log_level, f"worker={config.worker.index}")
    raise_descriptors()
    try:
        server = build_server(config, create_app(config, engines=engines) if engines else None)
    except ConfigError as exc:
        logger.error("worker: %s", exc.message)
        logging.shutdown()
        os._exit(2)  # now: the supervisor's stop (SIGUSR1) may be on its way

    def stop_steps() -> None:
        """Each byte on the input is a step of the supervisor's stop (a signal would do, but
        two sent close together may arrive as one); its end is the supervisor's."""
        with contextlib.suppress(OSError):
            while steps := os.read(sys.stdin.fileno(), 4096):
                for _ in steps:
                    server.handle_exit(signal.SIGUSR1, None)
        if sys.platform.startswith("linux"):
            # A supervisor that died (kill -9) closes this input a moment before the kernel's
            # PR_SET_PDEATHSIG kills this worker: wait for that, so that it ends as one process
            # killed does (no drain, no audit seal).
            time.sleep(0.5)
        server.handle_exit(signal.SIGUSR1, None)

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # from now on the input says it
    threading.Thread(target=stop_steps, name="supervisor", daemon=True).start()
    server.run(sockets=[bind_shared(config.host, config.port)])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
