"""Network namespaces for the tests: :class:`~seedance.testing.regions.Regions`, and a skip
with the reason where they cannot be made."""

from __future__ import annotations

import pytest

from seedance.testing.regions import (
    EDGE_ADDRESS,
    EDGE_ON_LINK,
    FAR_ADDRESS,
    FAR_ON_LINK,
    Regions,
    available,
)
from tests.support.tools import tool

__all__ = [
    "EDGE_ADDRESS",
    "EDGE_ON_LINK",
    "FAR_ADDRESS",
    "FAR_ON_LINK",
    "Regions",
    "need_namespaces",
]


def need_namespaces() -> None:
    tool("ip", "iproute2")
    why = available()
    if why is not None:
        pytest.skip(why)
