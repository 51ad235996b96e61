"""A small synchronous wrapper for scripts: the asyncio client on a private event loop.

::

    with connect_sync("ws://127.0.0.1:8000") as session:
        for chunk in session.generate("hello"):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

from seedance.client.session import ClientSession, Embeddings, Stream, TokenChunk, connect
from seedance.protocol.messages import DoneFrame, EmbeddingsFrame

T = TypeVar("T")


class SyncStream:
    """Iterator of :class:`TokenChunk`; :attr:`done` and :attr:`text` once it ends."""

    def __init__(self, owner: SyncSession, stream: Stream) -> None:
        self._owner = owner
        self._stream = stream

    @property
    def done(self) -> DoneFrame | None:
        return self._stream.done

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def __iter__(self) -> Iterator[TokenChunk]:
        while True:
            try:
                yield self._owner._call(self._stream.__anext__())
            except StopAsyncIteration:
                return

    def cancel(self) -> None:
        self._owner._call(self._stream.cancel())


class SyncSession:
    """Blocking counterpart of :class:`~seedance.client.ClientSession`."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="seedance-sync-client", daemon=True
        )
        self._thread.start()
        try:
            self._session: ClientSession = self._call(connect(url, **kwargs)._open())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def session_id(self) -> str:
        return self._session.session_id

    @property
    def model(self) -> str:
        return self._session.model

    def generate(self, prompt: str | None = None, **kwargs: Any) -> SyncStream:
        return SyncStream(self, self._session.generate(prompt, **kwargs))

    def complete(self, prompt: str | None = None, **kwargs: Any) -> DoneFrame:
        return self._call(self._session.complete(prompt, **kwargs))

    def embed(self, input: Any, **kwargs: Any) -> EmbeddingsFrame:
        return self._call(self._session.embed(input, **kwargs))

    def embed_array(self, input: Any, **kwargs: Any) -> Embeddings:
        return self._call(self._session.embed_array(input, **kwargs))

    def cancel(self, request_id: str | None = None) -> None:
        self._call(self._session.cancel(request_id))

    def ping(self, timeout_s: float = 10.0) -> float:
        return self._call(self._session.ping(timeout_s))

    def end(self) -> None:
        self._call(self._session.end())

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._call(self._session.close())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def connect_sync(url: str, **kwargs: Any) -> SyncSession:
    """Open a session and block until it is ready (same arguments as :func:`connect`)."""
    return SyncSession(url, **kwargs)
