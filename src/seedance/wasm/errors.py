"""How a tenant's module fails or refuses, as data.

Every way a module can end badly is one :class:`ModuleFailed` with a ``reason`` from this
table, so the server renders them in one place and a test can produce each one::

    reason             when                                                      instance after
    trap               the module trapped (unreachable, out-of-bounds access,   dead
                       division by zero, stack overflow, proc_exit, a bad
                       pointer passed to seedance.output or seedance.log)
    fuel               it ran out of fuel (Limits.fuel instructions, per call)  dead
    timeout            it ran past Limits.wall_s (its own code, or a backend    dead
                       call that used up the time)
    memory             its memory grew past Limits.memory_bytes during a call   dead
                       (however the call ended), or it starts with more
    forbidden_import   it imports something the host does not give it          not created
    bad_module         the bytes are not a valid WebAssembly module             not compiled
    bad_output         its text output is not UTF-8 (a filter may split a       dead
                       character across calls, but not at the reply's end)
    output_too_large   it passed more than Limits.output_bytes to               dead
                       seedance.output in one call
    bad_abi            an export is missing or has the wrong type, an import   dead (or not
                       of ours has the wrong type, seedance_alloc returned 0,   compiled)
                       or the caller asked for a role it does not export

A module that *chooses* not to go on is not a failure: it returns a code other than 0 (or 1 from
a filter) and the host raises :class:`ModuleRefused` with that code and what the module wrote as
the message (a pre-processor refusing a prompt, say). The instance stays usable.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

Reason = Literal[
    "trap",
    "fuel",
    "timeout",
    "memory",
    "forbidden_import",
    "bad_module",
    "bad_output",
    "output_too_large",
    "bad_abi",
]
REASONS: Final[tuple[str, ...]] = get_args(Reason)


class WasmError(Exception):
    """Base class of what calling a tenant's module can raise."""


class ModuleFailed(WasmError):
    """The module broke a rule of the sandbox; ``reason`` says which (see the module docstring).

    After it the instance that raised it is dead: every later call raises it again.
    """

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: Reason = reason
        self.message = message


class ModuleRefused(WasmError):
    """The module returned ``code`` (not 0, nor 1 from a filter): it declines to go on.

    ``message`` is what it passed to ``seedance.output`` before returning (invalid UTF-8 replaced).
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"module refused with code {code}: {message}")
        self.code = code
        self.message = message
