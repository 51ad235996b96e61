"""A WebAssembly sandbox for tenant modules: pre-processors, stream filters, post-processors and
pipelines that call served models through WASI-NN.

Use::

    host = WasmHost(cache_dir=Path("/var/cache/seedance/wasm"))   # one per server
    module = host.compile(wasm_bytes)          # compiled once per content, cached
    prompt = module.instantiate().preprocess(prompt)              # one instance per call
    flt = module.instantiate()                 # one instance for a whole reply
    for delta in reply:
        text, stop = flt.filter(delta)
        ...
    text = flt.filter_end()
    out = module.instantiate(backend=models).run(request_bytes)

Everything is synchronous: run it in a worker thread. Limits (fuel, wall clock, memory, output)
are in :class:`Limits` and enforced as :mod:`seedance.wasm.host` describes; every failure is a
:class:`ModuleFailed` whose ``reason`` is in :mod:`seedance.wasm.errors`' table.

The module ABI
==============

All integers are little-endian; pointers are i32 offsets into the module's exported memory
(32-bit); texts are UTF-8.

Exports every module must have:

- ``memory``: its linear memory.
- ``seedance_alloc(size: i32) -> i32``: where the host may write ``size`` bytes of input. The
  buffer is the module's from then on: free it when done (a filter's instance lives for the
  whole reply). Returning 0 fails the call (``bad_abi``). For an empty input the host does not
  call it and passes ``(0, 0)``.

Then one or more roles, each ``(ptr: i32, len: i32) -> i32`` with its input at ``(ptr, len)``:

- ``seedance_preprocess``: the prompt (text) in, the prompt out. Fresh instance per call.
- ``seedance_filter``: one delta (text) of the reply in, text to send out; the instance lives
  for the whole reply, so the module may hold text back across calls (in its memory). Optional
  ``seedance_filter_end() -> i32``: called once when the reply ends, to flush what it held
  (0 and 1 both mean done there; anything else is a refusal).
- ``seedance_postprocess``: the whole reply (text) in, text out. Fresh instance per call.
- ``seedance_run``: a pipeline, bytes in, bytes out. Fresh instance per call.

A role writes its output by calling ``seedance.output(ptr, len)`` zero or more times (the
output is the concatenation) and returns:

- ``0``: done (a filter: go on);
- ``1``: a filter only: stop the reply after this output (from any other role: a refusal);
- anything else: the module refuses; the host raises :class:`ModuleRefused` with that code and
  the output written so far as its message (a pre-processor refusing a prompt, say).

Text output must be UTF-8 (``bad_output``); a filter may split a character across calls, but
the reply's last output may not end inside one.

Limits a module runs under (:class:`Limits`, defaults): per call 50 M fuel (about one wasm
instruction each), 2 s of wall-clock time (backend calls included) and 1 MiB of output; 64 MiB
of memory for the instance. Growing memory past that limit fails the call when it ends, however
it ends; a ``memory.grow`` returns -1 only past the limit plus 1/16 of it.

Imports (the host gives these and nothing else; importing anything more is refused at
instantiation with ``forbidden_import``, naming it, unless the caller grants
``wasi_snapshot_preview1``: then WASI with nothing preopened, no environment, no arguments,
stdin empty and stdout/stderr discarded; clocks and random come with it):

Module ``seedance``:

- ``output(ptr: i32, len: i32)``: append to this call's output (at most ``Limits.output_bytes``
  per call: ``output_too_large``). A range outside the memory traps the module (``trap``).
- ``log(ptr: i32, len: i32)``: one line for the server's log (``seedance.wasm`` logger, INFO),
  cut to 1 KiB; at most 100 lines per call, the rest dropped and counted.

Module ``wasi_ephemeral_nn`` (WASI-NN's "ephemeral" witx ABI with WasmEdge's extensions, so a
module written for WasmEdge's wasi-nn plugin links here too). Every function returns an
``errno: i32``:

====  ===================== ====  =====================
0     success               6     unsupported_operation
1     invalid_argument      7     too_large
2     invalid_encoding      8     not_found
3     missing_memory        100   end_of_sequence
4     busy                  101   context_full
5     runtime_error         102   prompt_too_long
                            103   model_not_found
====  ===================== ====  =====================

- ``load(builder_ptr, builder_len, encoding, target, graph_out_ptr)``: loading model bytes is
  not offered: 6.
- ``load_by_name(name_ptr, name_len, graph_out_ptr)``: a served model by name (at most 256
  bytes); writes a u32 graph handle at ``graph_out_ptr``. A model that does not exist, or that
  this tenant may not use, is 103 (the same: no probing for models). Without a backend: 6.
- ``load_by_name_with_config(name_ptr, name_len, config_ptr, config_len, graph_out_ptr)``: the
  same with a JSON object (at most 64 KiB) passed to the backend; not an object: 1.
- ``init_execution_context(graph, ctx_out_ptr)``: writes a u32 context handle.
- ``set_input(ctx, index, tensor_ptr)``: index 0..15; the tensor struct is 20 bytes:
  ``dims_ptr u32 @0, dims_len u32 @4`` (count of u32 dims, at most 8), ``type u8 @8``
  (0 f16, 1 f32, 2 f64, 3 u8, 4 i32, 5 i64; 3 bytes padding), ``data_ptr u32 @12``,
  ``data_len u32 @16``. ``data_len`` must be the product of the dims times the type's size. A
  text prompt is a u8 tensor of dims ``[len]``.
- ``compute(ctx)``; then ``get_output(ctx, index, out_ptr, out_max, bytes_written_ptr)``
  copies output ``index`` to ``out_ptr`` and its size to ``bytes_written_ptr``; bigger than
  ``out_max``: 7, nothing copied, and the size needed at ``bytes_written_ptr``.
- Token streaming: ``compute_single(ctx)`` produces the next token (the first call starts the
  generation from the inputs set); ``get_output_single(ctx, index, out_ptr, out_max,
  bytes_written_ptr)`` gives that token's text (as ``get_output``); after the last token
  ``compute_single`` returns 100 and the stream is over. ``fini_single(ctx)`` ends it early:
  the backend's stream is closed, which cancels the generation. While a stream is open,
  ``set_input`` and ``compute`` on that context are 4.
- ``unload(graph)``, ``finalize_execution_context(ctx)``: release handles.

Handles are the instance's own: a module cannot name another request's graphs or contexts. At
most 16 graphs and 16 contexts at once (4, busy). Every pointer and length is checked against
the memory's size: out of bounds is 1, never a crash. A backend error maps to its errno; an
unexpected one is 5 (and logged). Everything an instance held is released when it ends (an
open stream is closed).

Building a module from C (wasi-libc for ``malloc``)::

    clang --target=wasm32-wasi -O2 -nostartfiles -Wl,--no-entry -Wl,--export-dynamic \\
        -o module.wasm module.c

with the imports declared as
``__attribute__((import_module("seedance"), import_name("output")))`` and the exports marked
``__attribute__((export_name("seedance_filter")))``; ``examples/wasm/redact.c`` is a complete
stream filter.
"""

from seedance.wasm.errors import REASONS, ModuleFailed, ModuleRefused, Reason, WasmError
from seedance.wasm.host import CacheStats, CompiledModule, Instance, Limits, WasmHost
from seedance.wasm.nn import Errno, NNBackend, NNError, NNGraph, TensorType, TokenStream

__all__ = [
    "REASONS",
    "CacheStats",
    "CompiledModule",
    "Errno",
    "Instance",
    "Limits",
    "ModuleFailed",
    "ModuleRefused",
    "NNBackend",
    "NNError",
    "NNGraph",
    "Reason",
    "TensorType",
    "TokenStream",
    "WasmError",
    "WasmHost",
]
