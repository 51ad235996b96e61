"""``python -m seedance.engines.core``: the engine process (see :mod:`.child`)."""

import sys

from seedance.engines.core.child import main

sys.exit(main())
