"""The served models: each name's stable version and its canary, and the one place that
resolves a request's model and holds it to its limits.

A model is served under a name, bound to its engine, its admission queue and its frame
limits. A registry's version also carries the limits its signed manifest names
(``context_length``, ``max_tokens``, ``temperature`` and ``top_p`` ranges): every API asks
:meth:`ServedModel.check` before it admits a request, so a request outside them is refused with
``invalid_request`` naming the limit and the version, and one that leaves a field out gets a
default inside them.

The table is written by the model manager only (a reload swaps a version in, a canary comes
or goes) and read by everything else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from msgspec import structs

from seedance.config import ConfigError
from seedance.engines.base import bound_to
from seedance.protocol.codec import FrameLimits
from seedance.protocol.errors import InvalidRequest, ModelNotFound
from seedance.protocol.schemas import output_schema
from seedance.protocol.tokenize import check_tokens
from seedance.protocol.tools import offered
from seedance.server.admission import Admission

if TYPE_CHECKING:
    from seedance.config import ServerConfig
    from seedance.engines.base import Engine
    from seedance.models.registry import Limits
    from seedance.protocol.messages import Generate


def share_of(key: str) -> float:
    """Where ``key`` falls in [0, 1): the same for a key on every node and every run."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class ServedModel:
    """A model name bound to its engine, admission queue and frame limits (and, from a
    registry, its version, the hash of its signed manifest and the limits it signs)."""

    name: str
    engine: Engine
    admission: Admission
    limits: FrameLimits
    version: str = ""
    manifest_sha256: str = ""
    signed: Limits | None = None

    @classmethod
    def of(
        cls,
        config: ServerConfig,
        engine: Engine,
        version: str = "",
        manifest: str = "",
        signed: Limits | None = None,
    ) -> ServedModel:
        info = engine.info
        limits = FrameLimits(
            max_frame_bytes=config.max_frame_bytes, max_tokens=info.max_output_tokens
        )
        if signed is not None:  # a request that leaves a field out gets a default inside them
            limits = replace(limits, temperature=signed.temperature, top_p=signed.top_p)
            limits = limits.capped(signed.max_tokens)
        return cls(
            name=info.name,
            engine=engine,
            admission=Admission(
                max_running=config.max_running or engine.max_concurrency,
                max_waiting=config.max_waiting,
            ),
            limits=limits,
            version=version,
            manifest_sha256=manifest,
            signed=signed,
        )

    @property
    def max_tokens(self) -> int:
        """The most tokens a reply may ask for: the engine's, or the signed limit if lower."""
        signed = self.signed.max_tokens if self.signed is not None else None
        return min(self.limits.max_tokens, signed or self.limits.max_tokens)

    @property
    def context_length(self) -> int:
        """The context window a prompt and its reply must fit: the engine's, or the signed
        limit if lower."""
        engine = self.engine.info.context_length
        signed = self.signed.context_length if self.signed is not None else None
        return min(engine, signed or engine)

    def signed_by(self) -> str:
        return f"model {self.name} version {self.version}"

    def check_ids(self, ids: list[int]) -> None:
        """A prompt of token ids: an engine that takes them, each an id of the model's
        vocabulary (:class:`InvalidRequest` naming the first that is not)."""
        engine = self.engine
        tokenizer = engine.tokenizer()
        if not engine.token_ids or tokenizer is None:
            info = engine.info
            raise InvalidRequest(
                f"prompt_ids: the {info.engine} engine of model {info.name} takes no token ids",
                param="prompt_ids",
            )
        check_tokens(ids, tokenizer.vocab_size, self.name, "prompt_ids", param="prompt_ids")

    def check(
        self, message: Generate, *, field: str = "max_tokens", schema_field: str = "schema"
    ) -> Generate:
        """``message`` held to this model's limits (``field``: what the API calls
        ``max_tokens``); :class:`InvalidRequest` naming the limit (and, for a signed one, the
        version) when it asks for more, or naming ``schema_field`` when the engine cannot
        bind its reply to the schema asked for."""
        if self.limits.max_tokens < message.max_tokens:
            raise InvalidRequest(f"{field} must be between 1 and {self.limits.max_tokens}")
        if message.schema is not None:
            self.engine.check_schema(output_schema(message.schema, schema_field), schema_field)
        elif message.tools:
            bound = bound_to(message, offered(message, self.engine.call_format))
            if bound is not None:
                self.engine.check_schema(bound, "tools")
        if message.logprobs is not None and not self.engine.logprobs:
            engine = self.engine.info
            raise InvalidRequest(
                f"logprobs: the {engine.engine} engine of model {engine.name} gives no log "
                "probabilities",
                param="logprobs",
            )
        if message.prompt_ids is not None:
            self.check_ids(message.prompt_ids)
        if message.tensors and "token_ids" in message.tensors and not self.engine.token_ids:
            engine = self.engine.info
            raise InvalidRequest(
                f"tensors: the {engine.engine} engine of model {engine.name} gives no token ids",
                param="tensors",
            )
        signed = self.signed
        if signed is None:
            return message
        if signed.max_tokens is not None and message.max_tokens > signed.max_tokens:
            raise InvalidRequest(
                f"{field}: {message.max_tokens} is over the limit of {signed.max_tokens} "
                f"signed for {self.signed_by()}"
            )
        for name, value, bounds in (
            ("temperature", message.temperature, signed.temperature),
            ("top_p", message.top_p, signed.top_p),
        ):
            if bounds is not None and not bounds[0] <= value <= bounds[1]:
                raise InvalidRequest(
                    f"{name}: {value:g} is outside the range {bounds[0]:g} to {bounds[1]:g} "
                    f"signed for {self.signed_by()}"
                )
        return message

    def within_defaults(self, message: Generate, unset: frozenset[str]) -> Generate:
        """The fields a client left out (``unset``; ``max_tokens`` among them) moved inside this
        model's limits (the server's own defaults may lie outside them)."""
        limits = self.limits
        changes: dict[str, float | int] = {}
        if (
            "max_tokens" in unset
            and limits.default_max_tokens(message.max_tokens) < message.max_tokens
        ):
            changes["max_tokens"] = limits.default_max_tokens(message.max_tokens)
        if "temperature" in unset and limits.temperature is not None:
            changes["temperature"] = limits.default_temperature(message.temperature)
        if "top_p" in unset and limits.top_p is not None:
            changes["top_p"] = limits.default_top_p(message.top_p)
        return structs.replace(message, **changes) if changes else message

    def context_refusal(self, prompt_tokens: int) -> InvalidRequest | None:
        """A prompt that fits the engine's window but not the signed ``context_length``."""
        signed = self.signed.context_length if self.signed is not None else None
        if signed is None or signed >= self.engine.info.context_length:
            return None
        need = prompt_tokens + self.engine.reply_overhead_tokens
        if need < signed:
            return None
        return InvalidRequest(
            f"the prompt takes {need} tokens, over the context length of {signed} signed for "
            f"{self.signed_by()}; shorten it"
        )


class ModelTable(Mapping[str, ServedModel]):
    """The stable version of every served model name (the first is the default), and the
    canaries beside some of them."""

    def __init__(self, config: ServerConfig, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ConfigError("no engine to serve")
        self._stable: dict[str, ServedModel] = {}
        for engine in engines:
            name = engine.info.name
            if name in self._stable:
                raise ConfigError(f"two engines serve the model name {name!r}")
            self._stable[name] = ServedModel.of(config, engine)
        self.default = engines[0].info.name
        #: Canary versions by model name, with the share of sessions they take.
        self.canaries: dict[str, tuple[ServedModel, float]] = {}

    # Mapping: the stable versions by name.
    def __getitem__(self, name: str) -> ServedModel:
        return self._stable[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stable)

    def __len__(self) -> int:
        return len(self._stable)

    def resolve(self, name: str | None, sticky: str | None = None) -> ServedModel:
        """The served model ``name`` (None: the default); with a canary of it, the canary for
        the share of ``sticky`` keys (a session id) it takes."""
        model = self._stable.get(name or self.default)
        if model is None:
            served = ", ".join(sorted(self._stable))
            raise ModelNotFound(f"model {name!r} is not served here; served models: {served}")
        canary = self.canaries.get(model.name)
        if canary is not None and sticky is not None and share_of(sticky) < canary[1]:
            return canary[0]
        return model

    def versions(self) -> list[ServedModel]:
        """Every model version serving now: the stable ones and the canaries."""
        return [*self._stable.values(), *(canary for canary, _ in self.canaries.values())]

    @property
    def max_tokens(self) -> int:
        """The largest ``max_tokens`` any served model takes: HTTP bodies are read against
        it, then held to the model they name."""
        return max(m.limits.max_tokens for m in self._stable.values())

    @property
    def running(self) -> int:
        """Generations admitted or waiting for admission, every version counted."""
        return sum(m.admission.running + m.admission.waiting for m in self.versions())

    # Written by the model manager alone.
    def swap(self, model: ServedModel) -> None:
        """``model`` serves its name from now on (a reload, a promoted canary)."""
        self._stable[model.name] = model

    def set_canary(self, model: ServedModel, share: float) -> None:
        self.canaries[model.name] = (model, share)

    def drop_canary(self, name: str) -> ServedModel | None:
        canary = self.canaries.pop(name, None)
        return canary[0] if canary is not None else None
