"""Seedance: a WebSocket-native LLM inference server and gateway."""

__version__ = "0.1.0"
SERVER_NAME = f"seedance/{__version__}"

__all__ = ["SERVER_NAME", "__version__"]
