"""The module ABI as tables, and the pure checks of a module's imports and exports against them.

Kept apart from wasmtime: a module is described here by plain tuples (``Sig``: parameter and
result type names, ``None`` for something that is not a function), so the rules read as data
and are tested without compiling anything. The ABI itself is written down in the package
docstring (:mod:`seedance.wasm`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from seedance.wasm.errors import ModuleFailed

#: (parameter types, result types), by wasm type name ("i32", "i64", ...).
Sig = tuple[tuple[str, ...], tuple[str, ...]]

_I32: Final = "i32"


def _sig(params: int, results: int) -> Sig:
    return ((_I32,) * params, (_I32,) * results)


SEEDANCE: Final = "seedance"
WASI_NN: Final = "wasi_ephemeral_nn"
WASI_P1: Final = "wasi_snapshot_preview1"

#: Every function the host gives a module, with its type. Nothing else is linked.
HOST_FUNCTIONS: Final[Mapping[tuple[str, str], Sig]] = {
    (SEEDANCE, "output"): _sig(2, 0),
    (SEEDANCE, "log"): _sig(2, 0),
    (WASI_NN, "load"): _sig(5, 1),
    (WASI_NN, "load_by_name"): _sig(3, 1),
    (WASI_NN, "load_by_name_with_config"): _sig(5, 1),
    (WASI_NN, "init_execution_context"): _sig(2, 1),
    (WASI_NN, "set_input"): _sig(3, 1),
    (WASI_NN, "compute"): _sig(1, 1),
    (WASI_NN, "get_output"): _sig(5, 1),
    (WASI_NN, "compute_single"): _sig(1, 1),
    (WASI_NN, "get_output_single"): _sig(5, 1),
    (WASI_NN, "fini_single"): _sig(1, 1),
    (WASI_NN, "unload"): _sig(1, 1),
    (WASI_NN, "finalize_execution_context"): _sig(1, 1),
}
HOST_MODULES: Final = frozenset(module for module, _ in HOST_FUNCTIONS)
#: Import modules a caller may grant on top (``allow=``); only WASI preview 1, which the host
#: gives with nothing preopened, no environment, no arguments and output discarded.
ALLOWABLE: Final = frozenset({WASI_P1})

#: Role name -> the export that plays it, all ``(ptr: i32, len: i32) -> i32``.
ROLES: Final[Mapping[str, str]] = {
    "preprocess": "seedance_preprocess",
    "filter": "seedance_filter",
    "postprocess": "seedance_postprocess",
    "run": "seedance_run",
}
ALLOC: Final = "seedance_alloc"
FILTER_END: Final = "seedance_filter_end"
MEMORY: Final = "memory"
_EXPORT_SIGS: Final[Mapping[str, Sig]] = {
    ALLOC: _sig(1, 1),
    FILTER_END: _sig(0, 1),
    **{export: _sig(2, 1) for export in ROLES.values()},
}


@dataclass(frozen=True, slots=True)
class Exports:
    """What a module's exports offer the host, once they passed :func:`check_exports`."""

    roles: frozenset[str]
    has_filter_end: bool


def _show(sig: Sig) -> str:
    return f"({', '.join(sig[0])}) -> ({', '.join(sig[1])})"


def check_exports(exports: Mapping[str, Sig | str]) -> Exports:
    """The roles a module plays, or ``bad_abi`` naming the export that breaks the ABI.

    ``exports`` maps an export's name to its ``Sig`` when it is a function, else to its kind
    ("memory", "global", "table").
    """
    if exports.get(MEMORY) != "memory":
        raise ModuleFailed("bad_abi", "the module must export its memory as 'memory'")
    if ALLOC not in exports:
        raise ModuleFailed("bad_abi", f"the module must export {ALLOC}(size: i32) -> i32")
    for name, want in _EXPORT_SIGS.items():
        got = exports.get(name)
        if got is not None and got != want:
            shown = got if isinstance(got, str) else _show(got)
            raise ModuleFailed("bad_abi", f"export {name} must be {_show(want)}, not {shown}")
    roles = frozenset(role for role, export in ROLES.items() if export in exports)
    if not roles:
        raise ModuleFailed(
            "bad_abi", f"the module exports none of {', '.join(ROLES.values())}: it has no role"
        )
    return Exports(roles=roles, has_filter_end=FILTER_END in exports)


def check_imports(imports: Iterable[tuple[str, str, Sig | None]]) -> None:
    """Refuse imports from our own modules that do not exist (``forbidden_import``) or have the
    wrong type (``bad_abi``); imports from other modules are :func:`forbidden_imports`' job."""
    for module, name, sig in imports:
        if module not in HOST_MODULES:
            continue
        want = HOST_FUNCTIONS.get((module, name))
        if want is None:
            raise ModuleFailed(
                "forbidden_import", f"import {module}.{name}: the host has no such function"
            )
        if sig != want:
            shown = "not a function" if sig is None else _show(sig)
            raise ModuleFailed(
                "bad_abi", f"import {module}.{name} must be {_show(want)}, not {shown}"
            )


def forbidden_imports(
    imports: Iterable[tuple[str, str, Sig | None]], allow: frozenset[str]
) -> list[str]:
    """The imports (``module.name``) from modules neither the host's nor granted in ``allow``."""
    granted = HOST_MODULES | allow
    return [f"{module}.{name}" for module, name, _ in imports if module not in granted]


def check_allow(allow: frozenset[str]) -> None:
    """Only :data:`ALLOWABLE` modules can be granted: the host has nothing else to give."""
    unknown = sorted(allow - ALLOWABLE)
    if unknown:
        raise ValueError(
            f"allow: the host can only grant {', '.join(sorted(ALLOWABLE))}, not "
            f"{', '.join(unknown)}"
        )
