"""A third-party engine with an option of its own, for the configuration tests: the synthetic
engine served under the name ``--serve-as`` gives. Registered through the ``seedance.engines``
entry point group by a ``.dist-info`` folder that the test writes, like any installed plugin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from seedance.engines.registry import EngineSpec
from seedance.engines.synthetic import SyntheticEngine
from seedance.settings import Option


@dataclass(frozen=True)
class NamedOptions:
    serve_as: str = "plugin-model"


def create_engine(config: Any, options: NamedOptions) -> SyntheticEngine:
    return SyntheticEngine(name=options.serve_as)


ENGINE = EngineSpec(
    create_engine,
    NamedOptions,
    (Option("serve_as", "--serve-as", str, "the name the model is served under"),),
    "A plugin's engine, for the tests.",
)


def factory(config: Any) -> SyntheticEngine:
    """A plugin without options of its own: a plain factory."""
    return SyntheticEngine(name="plain")
