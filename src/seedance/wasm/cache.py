"""Compiled modules kept in memory (LRU) and, optionally, on disk across restarts.

Compiling a module with Cranelift takes milliseconds to seconds; instantiating a compiled one
takes microseconds. So a module is compiled once per content (its SHA-256), the result kept in
an in-memory LRU, and serialized machine code written to a cache directory so that a restart
loads it instead of compiling again.

The directory must be the server's alone: what is in it is loaded as native code, trusted. A
file's name carries the wasmtime version and the engine's settings, and wasmtime refuses a file
made by another version or configuration anyway; a file it refuses is removed and compiled
again. Files are written whole (a temporary file renamed), so a crash leaves no torn file.

A file is read into memory and deserialized from there (``Module.deserialize``), not mapped
(``Module.deserialize_file``): code mapped from a file that something later truncates in place
kills the whole process with SIGBUS the next time a page of it is touched (seen in this
package's tests), while a copy costs a few hundred kilobytes once per module per process.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Generic, TypeVar

import wasmtime

log = logging.getLogger("seedance.wasm")

_K = TypeVar("_K")
_V = TypeVar("_V")


class LRU(Generic[_K, _V]):
    """At most ``capacity`` entries; the least recently used goes first. Not locked."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("an LRU holds at least one entry")
        self.capacity = capacity
        self._entries: OrderedDict[_K, _V] = OrderedDict()

    def get(self, key: _K) -> _V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: _K, value: _V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class DiskCache:
    """Serialized modules in ``directory``, one file per module content and engine
    ``fingerprint`` (wasmtime's version and the settings that change the machine code)."""

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.directory / f"{sha256}-{self.fingerprint}.cwasm"

    def load(self, engine: wasmtime.Engine, sha256: str) -> wasmtime.Module | None:
        """The module compiled earlier, or ``None`` (absent, or refused by wasmtime: removed)."""
        path = self.path(sha256)
        try:
            return wasmtime.Module.deserialize(engine, path.read_bytes())
        except OSError:
            return None
        except wasmtime.WasmtimeError as e:
            log.warning("dropping cached module %s: %s", path.name, str(e).splitlines()[0])
            path.unlink(missing_ok=True)
            return None

    def store(self, sha256: str, module: wasmtime.Module) -> None:
        """Write the module whole; a failure to write is logged, never raised (it is a cache)."""
        try:
            data = module.serialize()
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path(sha256))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (OSError, wasmtime.WasmtimeError):
            log.warning("could not cache module %s on disk", sha256[:12], exc_info=True)
