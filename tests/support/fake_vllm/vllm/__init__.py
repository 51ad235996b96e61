"""A fake vLLM for Seedance's unit tests (see ../README.md)."""

import os

__version__ = os.environ.get("FAKE_VLLM_VERSION", "0.33.0")


def version() -> tuple[int, int]:
    major, minor = __version__.split(".")[:2]
    return int(major), int(minor)
