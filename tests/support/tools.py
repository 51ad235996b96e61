"""The programs the tests run for real (Debian packages that ``.ci/run`` installs)."""

from __future__ import annotations

import shutil

import pytest


def tool(name: str, package: str) -> str:
    """The path of ``name``; the test is skipped when it is not installed."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {package}; .ci/run installs it)")
    return path
