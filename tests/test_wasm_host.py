"""The WebAssembly sandbox (seedance.wasm): each role with a real C module, the example redact
filter, WASI-NN against an in-process fake of Seedance's engines, every limit with a hostile
module, and the compiled-module cache.

The C modules (tests/wasm/*.c, examples/wasm/redact.c) are built with clang into a temporary
directory once per session; tests that need them skip, saying why, without clang, wasm-ld or
wasi-libc. The WAT ones need nothing.
"""

from __future__ import annotations

import logging
import re
import statistics
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import wasmtime
from numpy.typing import NDArray

from seedance.wasm import (
    Errno,
    Limits,
    ModuleFailed,
    ModuleRefused,
    NNError,
    WasmHost,
    abi,
)
from seedance.wasm.host import memory_slack
from seedance.wasm.nn import TENSOR_STRUCT, NNSession, OutOfBounds, TensorType
from tests.support.wasm import SOURCES, Builder


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Builder:
    """``build("upper")``: tests/wasm/upper.c compiled (``"redact"``: the shipped example)."""
    return Builder(tmp_path_factory.mktemp("wasm-build"))


@pytest.fixture(scope="module")
def host() -> Iterator[WasmHost]:
    with WasmHost() as h:
        yield h


def wat(text: str) -> bytes:
    return bytes(wasmtime.wat2wasm(text))


# An in-process stand-in for Seedance's engines behind WASI-NN.


class FakeGraph:
    def __init__(self, backend: FakeBackend, name: str, config: dict[str, Any] | None) -> None:
        self.backend = backend
        self.name = name
        self.config = config or {}

    def compute(self, inputs: dict[int, NDArray[Any]]) -> dict[int, NDArray[Any]]:
        self.backend.seen.append(inputs)
        if self.name == "sum":
            return {0: np.array([inputs[0].sum()], dtype=np.float32)}
        text = b"echo: " + inputs[0].tobytes()
        if self.config.get("upper"):
            text = text.upper()
        return {0: np.frombuffer(text, dtype=np.uint8)}

    def stream(self, inputs: dict[int, NDArray[Any]]) -> Generator[bytes, None, None]:
        self.backend.seen.append(inputs)
        record = {"tokens": 0, "closed": False}
        self.backend.streams.append(record)
        self.backend.streaming.set()
        words = inputs[0].tobytes().split(b" ")
        try:
            while True:
                if self.name == "slow":
                    time.sleep(0.05)
                    token = b"zzz"
                elif record["tokens"] < len(words):
                    token = words[record["tokens"]]
                else:
                    return
                record["tokens"] += 1
                yield token
        finally:
            record["closed"] = True


class FakeBackend:
    """Models "echo", "sum" and "slow"; "secret" exists but this tenant may not use it."""

    def __init__(self, load_s: float = 0.0) -> None:
        self.load_s = load_s
        self.seen: list[dict[int, NDArray[Any]]] = []
        self.configs: list[dict[str, Any] | None] = []
        self.streams: list[dict[str, Any]] = []
        self.streaming = threading.Event()

    def load(self, name: str, config: dict[str, Any] | None) -> FakeGraph:
        self.configs.append(config)
        time.sleep(self.load_s)
        if name not in ("echo", "sum", "slow"):
            raise NNError(Errno.MODEL_NOT_FOUND, name)
        return FakeGraph(self, name, config)


# Each role with a real C module.


def test_preprocess_upper_cases_the_prompt_and_logs(
    host: WasmHost, build: Callable[[str], bytes], caplog: pytest.LogCaptureFixture
) -> None:
    module = host.compile(build("upper"))
    assert module.roles == {"preprocess"}
    assert sorted(module.imports) == [("seedance", "log"), ("seedance", "output")]
    with caplog.at_level(logging.INFO, logger="seedance.wasm"):
        assert module.instantiate().preprocess("Hello, wörld!") == "HELLO, WöRLD!"
    assert any("upper: one prompt" in r.getMessage() for r in caplog.records)
    assert module.instantiate().preprocess("") == ""


def test_preprocess_refusal_carries_the_code_and_the_reason(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    instance = host.compile(build("upper")).instantiate()
    with pytest.raises(ModuleRefused) as refused:
        instance.preprocess("this is forbidden")
    assert (refused.value.code, refused.value.message) == (7, "prompt refused: it says forbidden")
    with pytest.raises(RuntimeError, match="one instance per call"):
        instance.preprocess("again")


def test_postprocess(host: WasmHost, build: Callable[[str], bytes]) -> None:
    module = host.compile(build("post"))
    assert module.roles == {"postprocess"}
    assert module.instantiate().postprocess("a\r\nb\nc") == "a\nb\nc\n-- lines: 3"


STOP_TEXT = "hello wor STO ld STOP never sent"


@pytest.mark.parametrize("split", range(len(STOP_TEXT) + 1))
def test_filter_stops_on_a_pattern_split_across_deltas(
    host: WasmHost, build: Callable[[str], bytes], split: int
) -> None:
    instance = host.compile(build("stopper")).instantiate()
    sent, stopped = [], False
    for delta in (STOP_TEXT[:split], STOP_TEXT[split:]):
        text, stopped = instance.filter(delta)
        sent.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(sent) == "hello wor STO ld "


def test_filter_holds_back_a_possible_start_and_flushes_it_at_the_end(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    instance = host.compile(build("stopper")).instantiate()
    assert instance.filter("one ST") == ("one ", False)
    assert instance.filter("") == ("", False)
    assert instance.filter("O") == ("", False)
    assert instance.filter("p") == ("STOp", False)
    assert instance.filter(" and S") == (" and ", False)
    assert instance.filter_end() == "S"


# The shipped example: examples/wasm/redact.c.

_TOKEN = re.compile(r"[A-Za-z0-9._%+@-]+")
_ADDRESS = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")


def redact_reference(text: str) -> str:
    """The rule redact.c states, applied to the whole text at once."""

    def token(match: re.Match[str]) -> str:
        whole = match.group()
        core = whole.rstrip(".")
        if len(whole) <= 256 and _ADDRESS.fullmatch(core):
            return "[redacted]" + whole[len(core) :]
        return re.sub(r"[0-9]{6,}", "[redacted]", whole)

    return _TOKEN.sub(token, text)


REDACT_TEXT = (
    "Mail jane.doe+tag@mail.example.org. or bob@x.io, not a@b or c@d.e1 or x@@y.com; "
    "call 12345 or 123456 or 0123456789ab, id=9876543. Déjà vu: ünïcode 1234567é ok@ok.de"
)


def filter_all(instance: Any, deltas: list[str]) -> str:
    out = []
    for delta in deltas:
        text, stop = instance.filter(delta)
        assert not stop
        out.append(text)
    out.append(instance.filter_end())
    return "".join(out)


def test_redact_example_on_deltas_split_at_every_position(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    module = host.compile(build("redact"))
    assert module.roles == {"filter"} and module.has_filter_end
    want = redact_reference(REDACT_TEXT)
    assert want.count("[redacted]") == 7
    assert filter_all(module.instantiate(), [REDACT_TEXT]) == want
    for i in range(len(REDACT_TEXT) + 1):
        deltas = [REDACT_TEXT[:i], REDACT_TEXT[i:]]
        assert filter_all(module.instantiate(), deltas) == want, deltas
    assert filter_all(module.instantiate(), list(REDACT_TEXT)) == want


def test_redact_example_holds_back_only_what_may_be_the_start_of_one(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    instance = host.compile(build("redact")).instantiate()
    assert instance.filter("Write to jane.d") == ("Write to ", False)
    assert instance.filter("oe@example.com or call 0123") == ("[redacted] or call ", False)
    assert instance.filter("456789 now") == ("[redacted] ", False)
    assert instance.filter_end() == "now"  # a word may be the start of an address


def test_redact_example_on_a_token_too_long_to_be_an_address(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    module = host.compile(build("redact"))
    text = "x" * 250 + "1234567" + "y" * 20 + "12345@example.com end"
    want = redact_reference(text)
    assert want == "x" * 250 + "[redacted]" + "y" * 20 + "12345@example.com end"
    for i in range(0, len(text) + 1, 7):
        assert filter_all(module.instantiate(), [text[:i], text[i:]]) == want
    # past 256 bytes only a digit run is held back
    instance = module.instantiate()
    assert instance.filter("z" * 300) == ("z" * 300, False)
    assert instance.filter("12345") == ("", False)
    assert instance.filter("z") == ("12345z", False)


# Pipelines through WASI-NN.


def test_pipeline_compute_and_get_output(host: WasmHost, build: Callable[[str], bytes]) -> None:
    backend = FakeBackend()
    module = host.compile(build("nnclient"))
    assert module.roles == {"run"}
    assert module.instantiate(backend).run(b"chello there") == b"echo: hello there"
    (inputs,) = backend.seen
    assert inputs[0].dtype == np.uint8 and inputs[0].shape == (11,)


def test_pipeline_passes_config_and_tensor_types(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    backend = FakeBackend()
    module = host.compile(build("nnclient"))
    # a config that is not a JSON object is invalid_argument (1); a good one reaches the backend
    assert module.instantiate(backend).run(b"ghi") == b"1:ECHO: HI"
    assert backend.configs == [{"upper": True}]
    out = module.instantiate(backend).run(b"t")
    assert struct.unpack("<f", out) == (10.0,)
    tensor = backend.seen[-1][0]
    assert tensor.dtype == np.float32 and tensor.shape == (2, 3)


def test_pipeline_streams_tokens_until_end_of_sequence(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    backend = FakeBackend()
    out = host.compile(build("nnclient")).instantiate(backend).run(b"sone two three")
    assert out == b"one|two|three"
    assert backend.streams == [{"tokens": 3, "closed": True}]


def test_fini_single_closes_the_backend_stream(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    backend = FakeBackend()
    out = host.compile(build("nnclient")).instantiate(backend).run(b"fa b c d e")
    assert out == b"a|b"
    assert backend.streams == [{"tokens": 2, "closed": True}]


def test_models_not_found_or_not_allowed_look_the_same(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    module = host.compile(build("nnclient"))
    assert module.instantiate(FakeBackend()).run(b"n") == b"103,103"
    assert module.instantiate(None).run(b"n") == b"6,6"  # no backend: nothing offered


def test_bad_pointers_passed_to_wasi_nn_are_invalid_argument(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    out = host.compile(build("nnclient")).instantiate(FakeBackend()).run(b"b")
    assert out == b"1,1,1,1,1,1,1,1,1,0,1,1,1,6"


def test_handles_per_instance_are_bounded(host: WasmHost, build: Callable[[str], bytes]) -> None:
    out = host.compile(build("nnclient")).instantiate(FakeBackend()).run(b"h")
    assert out == b"4,16"


def test_a_slow_backend_stream_ends_with_timeout(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    backend = FakeBackend()
    instance = host.compile(build("nnclient")).instantiate(backend, limits=Limits(wall_s=0.3))
    start = time.monotonic()
    with pytest.raises(ModuleFailed) as failed:
        instance.run(b"wgo")
    assert failed.value.reason == "timeout"
    assert time.monotonic() - start < 1.5
    assert backend.streams[0]["closed"]  # the instance's stream is closed when it dies
    assert 3 <= backend.streams[0]["tokens"] <= 8


def test_a_module_blocked_in_a_long_backend_call_ends_with_timeout(host: WasmHost) -> None:
    # It returns right after the call, reaching no epoch check: the host's own check stops it.
    module = host.compile(
        wat(f"""(module
          (import "wasi_ephemeral_nn" "load_by_name"
            (func $load (param i32 i32 i32) (result i32)))
          (memory (export "memory") 1) {_ALLOC}
          (data (i32.const 16) "echo")
          (func (export "seedance_run") (param i32 i32) (result i32)
            (drop (call $load (i32.const 16) (i32.const 4) (i32.const 32)))
            (i32.const 0)))""")
    )
    instance = module.instantiate(FakeBackend(load_s=0.4), limits=Limits(wall_s=0.1))
    with pytest.raises(ModuleFailed, match=r"^timeout: ran past the wall-clock bound of 0\.1 s"):
        instance.run(b"x")
    assert module.instantiate(FakeBackend()).run(b"x") == b""


def test_one_call_at_a_time_and_close_from_another_thread(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    backend = FakeBackend()
    instance = host.compile(build("nnclient")).instantiate(backend, limits=Limits(wall_s=0.6))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(instance.run, b"wgo")
        assert backend.streaming.wait(5)
        with pytest.raises(RuntimeError, match="one call at a time"):
            instance.run(b"c")
        instance.close()  # takes effect when the running call ends
        assert not backend.streams[0]["closed"]
        with pytest.raises(ModuleFailed, match=r"^timeout"):
            running.result()
    assert backend.streams[0]["closed"]
    with pytest.raises(ModuleFailed, match="failed earlier"):
        instance.run(b"c")


# Hostile modules: each ends with its reason, and the next call of a good module is served.

HOSTILE = [
    ("trap", Limits(), "trap", "unreachable"),
    ("div", Limits(), "trap", "divide by zero"),
    ("oob", Limits(), "trap", "wasm trap: out of bounds memory access"),
    ("loop", Limits(), "fuel", "fuel"),
    ("spin", Limits(fuel=10**15, wall_s=0.2), "timeout", "0.2 s"),
    ("bomb", Limits(memory_bytes=16 << 20), "memory", "past the limit of 16777216"),
    ("bigout", Limits(), "output_too_large", "1048576 bytes"),
    ("badptr", Limits(), "trap", "seedance.output(0xffffff00, 1000)"),
]


@pytest.mark.parametrize(("mode", "limits", "reason", "says"), HOSTILE)
def test_hostile_module_ends_with_its_reason(
    host: WasmHost,
    build: Callable[[str], bytes],
    mode: str,
    limits: Limits,
    reason: str,
    says: str,
) -> None:
    module = host.compile(build("hostile"))
    instance = module.instantiate(limits=limits)
    with pytest.raises(ModuleFailed) as failed:
        instance.run(mode.encode())
    assert failed.value.reason == reason
    assert says in failed.value.message
    with pytest.raises(ModuleFailed, match="failed earlier"):  # dead: no call goes in again
        instance.run(b"ok")
    assert module.instantiate().run(b"ok") == b"fine"
    assert host.compile(build("upper")).instantiate().preprocess("next") == "NEXT"


def test_log_lines_are_bounded_per_call(
    host: WasmHost, build: Callable[[str], bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="seedance.wasm"):
        assert host.compile(build("hostile")).instantiate().run(b"logspam") == b"logged"
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.endswith(": spam") for m in messages) == 100
    assert any("900 log lines dropped" in m for m in messages)


def test_refusal_from_a_pipeline(host: WasmHost, build: Callable[[str], bytes]) -> None:
    with pytest.raises(ModuleRefused) as refused:
        host.compile(build("hostile")).instantiate().run(b"refuse")
    assert (refused.value.code, refused.value.message) == (42, "not today")


def test_forbidden_import_is_refused_unless_allowed(
    host: WasmHost, build: Callable[[str], bytes], capfd: pytest.CaptureFixture[str]
) -> None:
    module = host.compile(build("printf"))
    assert ("wasi_snapshot_preview1", "fd_write") in module.imports
    with pytest.raises(ModuleFailed) as failed:
        module.instantiate()
    assert failed.value.reason == "forbidden_import"
    assert "wasi_snapshot_preview1.fd_write" in failed.value.message
    instance = module.instantiate(allow=frozenset({"wasi_snapshot_preview1"}))
    assert instance.preprocess("kept") == "kept"
    assert "a prompt of" not in capfd.readouterr().out  # stdout discarded
    with pytest.raises(ValueError, match="can only grant wasi_snapshot_preview1"):
        module.instantiate(allow=frozenset({"env"}))


def test_imports_of_other_modules_are_refused_even_with_wasi(host: WasmHost) -> None:
    module = host.compile(
        wat("""(module
          (import "env" "anything" (func))
          (memory (export "memory") 1)
          (func (export "seedance_alloc") (param i32) (result i32) (i32.const 0))
          (func (export "seedance_run") (param i32 i32) (result i32) (i32.const 0)))""")
    )
    for allow in (frozenset(), frozenset({"wasi_snapshot_preview1"})):
        with pytest.raises(ModuleFailed, match=r"forbidden_import: .*env\.anything"):
            module.instantiate(allow=allow)


_PRELUDE = """
  (import "seedance" "output" (func $out (param i32 i32)))
  (memory (export "memory") 1)
"""
_ALLOC = '(func (export "seedance_alloc") (param i32) (result i32) (i32.const 1024))'


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('(func (export "seedance_filter") (param i32 i32) (result i32) (i32.const 0))',
         "must export seedance_alloc"),
        (_ALLOC, "exports none of seedance_preprocess"),
        (_ALLOC + '(func (export "seedance_run") (param i32) (result i32) (i32.const 0))',
         "export seedance_run must be (i32, i32) -> (i32)"),
    ],
)  # fmt: skip
def test_a_module_that_breaks_the_export_abi_is_bad_abi(
    host: WasmHost, body: str, says: str
) -> None:
    with pytest.raises(ModuleFailed) as failed:
        host.compile(wat(f"(module {_PRELUDE} {body})"))
    assert failed.value.reason == "bad_abi"
    assert says in failed.value.message


def test_the_module_without_seedance_alloc_is_bad_abi(host: WasmHost) -> None:
    with pytest.raises(ModuleFailed) as failed:
        host.compile(wat((SOURCES / "noalloc.wat").read_text()))
    assert failed.value.reason == "bad_abi"
    assert "seedance_alloc" in failed.value.message


def test_imports_of_ours_must_exist_and_have_their_type(host: WasmHost) -> None:
    tail = f'{_ALLOC} (func (export "seedance_run") (param i32 i32) (result i32) (i32.const 0))'
    with pytest.raises(ModuleFailed, match=r"forbidden_import: import seedance\.exit"):
        host.compile(wat(f'(module (import "seedance" "exit" (func)) {_PRELUDE} {tail})'))
    with pytest.raises(ModuleFailed, match=r"bad_abi: import wasi_ephemeral_nn\.compute must"):
        host.compile(
            wat(f'(module (import "wasi_ephemeral_nn" "compute" (func)) {_PRELUDE} {tail})')
        )


def test_seedance_alloc_returning_zero_is_bad_abi(host: WasmHost) -> None:
    module = host.compile(
        wat(f"""(module {_PRELUDE}
          (func (export "seedance_alloc") (param i32) (result i32) (i32.const 0))
          (func (export "seedance_run") (param i32 i32) (result i32) (i32.const 0)))""")
    )
    with pytest.raises(ModuleFailed, match=r"bad_abi: seedance_alloc\(3\) returned 0"):
        module.instantiate().run(b"abc")
    assert module.instantiate().run(b"") == b""  # empty input: no allocation asked


def test_garbage_bytes_are_bad_module(host: WasmHost) -> None:
    for data in (b"garbage", b"(module)", b"\0asm\x01\0\0\0\x01\xff", b""):
        with pytest.raises(ModuleFailed) as failed:
            host.compile(data)
        assert failed.value.reason == "bad_module"


def test_initial_memory_over_the_limit_is_memory(host: WasmHost) -> None:
    module = host.compile(
        wat(f"""(module
          (import "seedance" "output" (func $out (param i32 i32)))
          (memory (export "memory") 2000) {_ALLOC}
          (func (export "seedance_run") (param i32 i32) (result i32) (i32.const 0)))""")
    )
    with pytest.raises(ModuleFailed, match=r"^memory: the module starts with"):
        module.instantiate()
    assert module.instantiate(limits=Limits(memory_bytes=200 << 20)).run(b"") == b""


_GROW = wat(f"""(module {_PRELUDE} {_ALLOC}
  ;; grow by 16 pages (1 MiB) at a time, as many times as the input's length says (0: until
  ;; refused), then trap if the input's first byte is "t"
  (func (export "seedance_run") (param $p i32) (param $n i32) (result i32)
    (local $left i32)
    (local.set $left (i32.sub (local.get $n) (i32.const 1)))
    (if (i32.eqz (local.get $left)) (then (local.set $left (i32.const -1))))
    (block $done
      (loop $grow
        (br_if $done (i32.eqz (local.get $left)))
        (local.set $left (i32.sub (local.get $left) (i32.const 1)))
        (br_if $grow (i32.ne (memory.grow (i32.const 16)) (i32.const -1)))))
    (if (i32.eq (i32.load8_u (local.get $p)) (i32.const 116)) (then unreachable))
    (i32.const 0)))""")


def test_memory_past_the_limit_is_memory_whether_the_module_traps_or_returns(
    host: WasmHost,
) -> None:
    module = host.compile(_GROW)
    limits = Limits(memory_bytes=8 << 20)
    assert memory_slack(8 << 20) == 512 << 10  # the store refuses a grow past 8.5 MiB
    for data, then in ((b"t", "then: wasm trap: wasm `unreachable`"), (b"r", "")):
        with pytest.raises(ModuleFailed) as failed:
            module.instantiate(limits=limits).run(data)
        assert failed.value.reason == "memory"
        assert failed.value.message.startswith("memory grew to 8454144 bytes, past the limit")
        assert then in failed.value.message
    # 1 page + 7 grows of 1 MiB: 7.06 MiB, under the limit
    assert module.instantiate(limits=limits).run(b"r" * 8) == b""


# UTF-8 output.

_SPLIT_CHAR = wat(f"""(module {_PRELUDE} {_ALLOC}
  (data (i32.const 16) "\\c3\\a9\\ff")
  (global $n (mut i32) (i32.const 0))
  ;; each call sends the next byte of "é": the character splits across calls
  (func (export "seedance_filter") (param i32 i32) (result i32)
    (call $out (i32.add (i32.const 16) (global.get $n)) (i32.const 1))
    (global.set $n (i32.add (global.get $n) (i32.const 1)))
    (i32.const 0))
  (func (export "seedance_preprocess") (param i32 i32) (result i32)
    (call $out (i32.const 18) (i32.const 1))
    (i32.const 0)))""")


def test_a_filter_may_split_a_character_across_calls_but_not_at_the_end(host: WasmHost) -> None:
    module = host.compile(_SPLIT_CHAR)
    instance = module.instantiate()
    assert instance.filter("a") == ("", False)
    assert instance.filter("b") == ("é", False)
    assert instance.filter_end() == ""
    instance = module.instantiate()
    assert instance.filter("a") == ("", False)
    with pytest.raises(ModuleFailed, match=r"^bad_output"):
        instance.filter_end()
    with pytest.raises(ModuleFailed, match=r"^bad_output"):
        module.instantiate().preprocess("x")


# The compiled-module cache.


def test_compiling_twice_compiles_once(build: Callable[[str], bytes]) -> None:
    with WasmHost() as fresh:
        first = fresh.compile(build("redact"))
        assert fresh.compile(build("redact")) is first
        assert (fresh.stats.compiled, fresh.stats.hits) == (1, 1)
        assert len(first.sha256) == 64


def test_the_disk_cache_survives_a_new_host(build: Callable[[str], bytes], tmp_path: Path) -> None:
    wasm = build("redact")
    with WasmHost(cache_dir=tmp_path) as first:
        sha = first.compile(wasm).sha256
        assert first.stats.compiled == 1
    (cached,) = tmp_path.glob(f"{sha}-*.cwasm")
    with WasmHost(cache_dir=tmp_path) as second:
        module = second.compile(wasm)
        assert (second.stats.compiled, second.stats.loaded_from_disk) == (0, 1)
        assert filter_all(module.instantiate(), ["call 1234", "567"]) == "call [redacted]"
    cached.write_bytes(b"not a compiled module")
    with WasmHost(cache_dir=tmp_path) as third:
        third.compile(wasm)
        assert (third.stats.compiled, third.stats.loaded_from_disk) == (1, 0)


def test_instantiating_from_the_cache_is_fast(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    module = host.compile(build("redact"))
    module.instantiate().close()  # the InstancePre is made once
    times = []
    for _ in range(200):
        start = time.perf_counter()
        instance = module.instantiate()
        times.append(time.perf_counter() - start)
        instance.close()
    # The goal is under 1 ms (a benchmark's job); this catches a regression by an order.
    assert statistics.median(times) < 0.005


def test_instances_in_threads_do_not_interfere(
    host: WasmHost, build: Callable[[str], bytes]
) -> None:
    redact = host.compile(build("redact"))
    upper = host.compile(build("upper"))
    hostile = host.compile(build("hostile"))
    barrier = threading.Barrier(6)

    def worker(n: int) -> list[str]:
        barrier.wait()
        results = []
        for i in range(20):
            text = f"thread {n} run {i}: mail t{n}@ex{i}.com, code {n}{i}0000000"
            instance = redact.instantiate()
            results.append(filter_all(instance, [text[: n + i], text[n + i :]]))
            results.append(upper.instantiate().preprocess(text))
            if i % 5 == n % 5:
                with pytest.raises(ModuleFailed, match=r"^fuel"):
                    hostile.instantiate().run(b"loop")
        return results

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(worker, range(6)))
    for n, results in enumerate(outcomes):
        for i in range(20):
            text = f"thread {n} run {i}: mail t{n}@ex{i}.com, code {n}{i}0000000"
            assert results[2 * i] == redact_reference(text)
            assert results[2 * i + 1] == text.upper()


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"Limits\.wall_s must be positive"):
        Limits(wall_s=0)


# The pure parts: the ABI tables and WASI-NN over a bytearray.


def test_check_exports_names_what_is_missing() -> None:
    i32 = ("i32",)
    good: dict[str, abi.Sig | str] = {
        "memory": "memory",
        "seedance_alloc": (i32, i32),
        "seedance_run": (i32 * 2, i32),
    }
    assert abi.check_exports(good).roles == {"run"}
    with pytest.raises(ModuleFailed, match="must export its memory"):
        abi.check_exports({**good, "memory": "global"})
    imports: list[tuple[str, str, abi.Sig | None]] = [
        ("seedance", "output", (i32 * 2, ())),
        ("env", "f", None),
        ("wasi_snapshot_preview1", "x", None),
    ]
    assert abi.forbidden_imports(imports, frozenset()) == ["env.f", "wasi_snapshot_preview1.x"]
    assert abi.forbidden_imports(imports, abi.ALLOWABLE) == ["env.f"]


class BytesMemory:
    def __init__(self, size: int = 4096) -> None:
        self.data = bytearray(size)

    def size(self) -> int:
        return len(self.data)

    def read(self, ptr: int, length: int) -> bytes:
        if ptr + length > len(self.data):
            raise OutOfBounds
        return bytes(self.data[ptr : ptr + length])

    def write(self, ptr: int, data: bytes) -> None:
        if ptr + len(data) > len(self.data):
            raise OutOfBounds
        self.data[ptr : ptr + len(data)] = data


def test_nn_session_too_large_reports_the_size_needed_and_writes_nothing() -> None:
    mem, session = BytesMemory(), NNSession(FakeBackend())
    mem.write(0, b"echo")
    assert session.load_by_name(mem, 0, 4, 100) == Errno.SUCCESS
    graph = int.from_bytes(mem.read(100, 4), "little")
    assert session.init_execution_context(mem, graph, 104) == Errno.SUCCESS
    ctx = int.from_bytes(mem.read(104, 4), "little")
    mem.write(200, b"hi")
    mem.write(300, struct.pack("<I", 2))
    mem.write(400, TENSOR_STRUCT.pack(300, 1, TensorType.U8, 200, 2))
    assert session.set_input(mem, ctx, 0, 400) == Errno.SUCCESS
    assert session.compute(mem, ctx) == Errno.SUCCESS
    assert session.get_output(mem, ctx, 0, 1000, 3, 500) == Errno.TOO_LARGE
    assert mem.read(500, 4) == struct.pack("<I", 8) and mem.read(1000, 8) == bytes(8)
    assert session.get_output(mem, ctx, 0, 1000, 8, 500) == Errno.SUCCESS
    assert mem.read(1000, 8) == b"echo: hi"
    assert session.get_output(mem, ctx, 0, 4090, 100, 500) == Errno.INVALID_ARGUMENT
    assert session.get_output(mem, ctx, 1, 1000, 8, 500) == Errno.INVALID_ARGUMENT
    # handles are this session's: another instance cannot name them
    other = NNSession(FakeBackend())
    assert other.init_execution_context(mem, graph, 104) == Errno.INVALID_ARGUMENT
    assert other.compute(mem, ctx) == Errno.INVALID_ARGUMENT
    assert session.finalize_execution_context(mem, ctx) == Errno.SUCCESS
    assert session.compute(mem, ctx) == Errno.INVALID_ARGUMENT
    assert session.unload(mem, graph) == Errno.SUCCESS


def test_nn_session_maps_backend_failures_to_errnos(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def load(self, name: str, config: dict[str, Any] | None) -> Any:
            if name == "full":
                raise NNError(Errno.CONTEXT_FULL, "no room")
            raise RuntimeError("a bug behind the backend")

    mem, session = BytesMemory(), NNSession(Broken())
    mem.write(0, b"full")
    assert session.load_by_name(mem, 0, 4, 100) == Errno.CONTEXT_FULL
    mem.write(0, b"oops")
    with caplog.at_level(logging.WARNING, logger="seedance.wasm"):
        assert session.load_by_name(mem, 0, 4, 100) == Errno.RUNTIME_ERROR
    assert "wasi-nn load_by_name failed" in caplog.text
    mem.write(0, b"\xff\xfe")
    assert session.load_by_name(mem, 0, 2, 100) == Errno.INVALID_ARGUMENT
    assert session.load_by_name(mem, -256, 4, 100) == Errno.INVALID_ARGUMENT  # 0xffffff00


def test_nn_session_checks_the_deadline_before_each_backend_call() -> None:
    calls = []

    def time_is_up() -> None:
        calls.append(1)
        raise NNError(Errno.RUNTIME_ERROR, "time is up")

    backend = FakeBackend()
    mem, session = BytesMemory(), NNSession(backend, time_is_up)
    mem.write(0, b"echo")
    assert session.load_by_name(mem, 0, 4, 100) == Errno.RUNTIME_ERROR
    assert calls == [1] and backend.configs == []
