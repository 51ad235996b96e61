"""WASI-NN over the request core: the served models a tenant's module reaches from inside its
sandbox (:mod:`seedance.wasm.nn` calls an :class:`EngineBackend`), each model call a request of
the tenant through the same admission, quotas and audit as every API, run on the event loop
while the module's thread waits for it (within the module's wall-clock bound).

A text model takes a u8 prompt (input 0, continued as it is: the completions API's raw prompt)
and gives its reply (output 0, u8), whole (``compute``) or token by token (``compute_single``);
``load_by_name_with_config`` sets its ``max_tokens``, ``temperature``, ``top_p`` and ``seed``.
An embedding model takes u8 text and gives its f32 vector.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from seedance.protocol.errors import InvalidRequest, ModelNotFound, SeedanceError
from seedance.protocol.messages import ErrorFrame
from seedance.server.lifecycle.admit import admit_raw, choose_model
from seedance.server.lifecycle.embed import embed
from seedance.server.lifecycle.reader import Reading, end_error
from seedance.wasm import Errno, NNError

if TYPE_CHECKING:
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.refusals import Arrival
    from seedance.server.lifecycle.services import Services
    from seedance.server.modules import ServedModule
    from seedance.tenants.auth import Principal


class EngineBackend:
    """The served models a tenant's module reaches through WASI-NN, each call a request of
    the tenant through the one request core (quotas, admission, audit), run on the event loop
    while the module's thread waits."""

    def __init__(
        self,
        services: Services,
        principal: Principal,
        module: ServedModule,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.services = services
        self.principal = principal
        self.module = module
        self.loop = loop

    def load(self, name: str, config: dict[str, Any] | None) -> _Graph:
        allowed = self.module.models
        try:
            if allowed is not None and name not in allowed:
                raise ModelNotFound(name)
            model = choose_model(self.services, self.principal, name, task=None)
        except SeedanceError:
            raise NNError(Errno.MODEL_NOT_FOUND, f"no model {name!r} for this module") from None
        return _Graph(self, model, config or {})

    def wait(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the loop and wait for it here (the module's thread)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(self.module.limits.wall_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise NNError(Errno.BUSY, "the model did not answer within the module's time") from None
        except SeedanceError as exc:
            raise NNError(Errno.RUNTIME_ERROR, f"{exc.code}: {exc.message}") from None


class _Graph:
    """One served model as a module sees it: a text model takes a u8 prompt (input 0) and
    gives the reply (output 0, u8), token by token if asked; an embedding model takes u8 text
    and gives its f32 vector."""

    def __init__(self, backend: EngineBackend, model: ServedModel, config: dict[str, Any]):
        self.backend = backend
        self.model = model
        self.config = config

    def _prompt(self, inputs: dict[int, np.ndarray]) -> str:
        data = inputs.get(0)
        if data is None or data.dtype != np.uint8:
            raise NNError(Errno.INVALID_ARGUMENT, "input 0: the text, a u8 tensor")
        try:
            return data.tobytes().decode()
        except UnicodeDecodeError:
            raise NNError(Errno.INVALID_ENCODING, "input 0: not UTF-8") from None

    def compute(self, inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        text = self._prompt(inputs)
        backend = self.backend
        if self.model.engine.task == "embed":
            vectors = backend.wait(_embed(backend, self.model, text))
            return {0: np.ascontiguousarray(vectors[0], dtype="<f4")}
        reply = b"".join(self.stream(inputs))
        return {0: np.frombuffer(reply, dtype=np.uint8)}

    def stream(self, inputs: dict[int, np.ndarray]) -> _Tokens:
        if self.model.engine.task == "embed":
            raise NNError(Errno.UNSUPPORTED_OPERATION, "an embedding model writes no tokens")
        text = self._prompt(inputs)
        backend = self.backend
        tokens: queue.Queue[str | BaseException | None] = queue.Queue()
        stop = threading.Event()
        future = asyncio.run_coroutine_threadsafe(
            _generate(backend, self.model, text, self.config, tokens, stop), backend.loop
        )
        return _Tokens(tokens, stop, future, backend.module.limits.wall_s)


class _Tokens:
    """A generation's tokens for the module's thread (``close()`` cancels it)."""

    def __init__(
        self,
        tokens: queue.Queue[str | BaseException | None],
        stop: threading.Event,
        future: concurrent.futures.Future[None],
        wall_s: float,
    ) -> None:
        self._tokens, self._stop, self._future = tokens, stop, future
        self._wall_s = wall_s

    def __iter__(self) -> _Tokens:
        return self

    def __next__(self) -> bytes:
        try:
            item = self._tokens.get(timeout=self._wall_s)
        except queue.Empty:
            self.close()
            raise NNError(Errno.BUSY, "the model did not answer within the module's time") from None
        if item is None:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item.encode()

    def close(self) -> None:
        self._stop.set()
        self._future.cancel()


async def _embed(backend: EngineBackend, model: ServedModel, text: str) -> np.ndarray:
    from seedance.protocol.embeddings import EmbeddingsRequest

    services = backend.services
    arrival = _arrival(backend, "embeddings")
    request = EmbeddingsRequest(model.name, (text,), "float", None)
    try:
        done = await embed(services, arrival, request)
    except SeedanceError as exc:
        services.refusals.refuse(arrival, exc)
        raise
    services.refusals.answered(arrival, "embedded", done.tokens)
    return done.vectors


async def _generate(
    backend: EngineBackend,
    model: ServedModel,
    text: str,
    config: dict[str, Any],
    tokens: queue.Queue[str | BaseException | None],
    stop: threading.Event,
) -> None:
    """A generation of ``text`` (continued raw) for a module, through the request core; its
    tokens into ``tokens``, then None (or the error that ended it)."""
    services = backend.services
    arrival = _arrival(backend, "text_completion")
    sampling = ("max_tokens", "temperature", "top_p", "seed")
    fields: dict[str, Any] = {k: config[k] for k in sampling if k in config}
    try:
        generation = admit_raw(
            services, arrival, backend.principal, model, text, fields, stream=True
        )
    except Exception as exc:
        error = exc if isinstance(exc, SeedanceError) else InvalidRequest(str(exc))
        services.refusals.refuse(arrival, error)
        tokens.put(NNError(Errno.RUNTIME_ERROR, f"{error.code}: {error.message}"))
        return
    try:
        with Reading(generation.log, generation) as reading:
            async for piece, _ in reading:
                if stop.is_set():
                    generation.cancel(silent=True)
                    return
                tokens.put(piece)
        end = reading.end
        if isinstance(end, ErrorFrame):
            error = end_error(end)
            tokens.put(NNError(Errno.RUNTIME_ERROR, f"{error.code}: {error.message}"))
            return
        tokens.put(None)
    except asyncio.CancelledError:
        generation.cancel(silent=True)
        raise


def _arrival(backend: EngineBackend, operation: str) -> Arrival:
    services = backend.services
    arrival = services.refusals.arrive("http", {}, operation, path=f"wasm:{backend.module.name}")
    arrival.principal = backend.principal
    return arrival
