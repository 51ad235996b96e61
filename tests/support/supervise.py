"""``python -m tests.support.supervise``: ``seedance serve --workers N`` for a test's own
settings and engines, as :class:`~tests.support.servers.RunningServer` builds them for one
process (``SEEDANCE_TEST_WORKERS``). Both come pickled on standard input, as
:mod:`seedance.children` hands a child its setup."""

from __future__ import annotations

import faulthandler
import sys

from seedance import children
from seedance.config import ConfigError
from seedance.observability.logs import configure_logging
from seedance.server.workers import Supervisor


def main() -> int:
    faulthandler.enable(file=sys.stderr, all_threads=True)
    config, engines = children.read_setup()
    configure_logging(config.log_level)
    try:
        supervisor = Supervisor(config, engines)
    except ConfigError as exc:
        print(f"seedance serve: error: {exc.message}", file=sys.stderr)
        return 2
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
