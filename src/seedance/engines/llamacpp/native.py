"""A thin, typed layer over llama.cpp's C API (through llama-cpp-python's ctypes bindings).

Only what the engine needs: load a GGUF model, tokenize and detokenize, read the chat template
from the metadata, and drive one context with several sequences (batch decode, per-sequence
samplers, removing a sequence's cells, saving and restoring a sequence's state).

A call that crosses into C releases the GIL (ctypes does), so the decode thread does not hold
up the event loop while llama.cpp computes; the few calls too short for that (sampling, the
end-of-generation check) keep it. ``llama_cpp.llama_cpp._lib``, private, is reached into:
llama-cpp-python is pinned to one release in ``pyproject.toml``.

Two process-wide hooks are set up with the backend: a build with runtime CPU dispatch
(``GGML_BACKEND_DL``, one ``libggml-cpu-<variant>`` per instruction set) gets its best CPU variant
loaded from the package's library folder, and a ``GGML_ABORT`` inside llama.cpp calls
:func:`on_abort`'s handler (to log the cause and report the engine down) before the process
aborts.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import llama_cpp as lc
import numpy as np
import numpy.typing as npt
from llama_cpp.llama_cpp import _lib as libllama

from seedance.config import ConfigError

logger = logging.getLogger(__name__)

_backend_lock: Final = threading.Lock()
_backend_ready = False
_LOG_LEVELS: Final = {2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}  # ggml levels


@lc.llama_log_callback  # type: ignore[untyped-decorator]
def _log_to_python(level: int, text: bytes, _user_data: Any) -> None:
    """llama.cpp's log lines go to the ``seedance.engines.llamacpp.native`` logger."""
    py_level = _LOG_LEVELS.get(level, logging.DEBUG)
    if logger.isEnabledFor(py_level):
        line = text.decode("utf-8", "replace").rstrip()
        if line:
            logger.log(py_level, "llama.cpp: %s", line)


#: llama-cpp-python's shared libraries (and, in a runtime-dispatch build, the CPU variants).
LIBRARY_DIR: Final = Path(lc.__file__).parent / "lib"

# Calls too short to be worth releasing the GIL for: a ctypes call releases and takes it back,
# and taking it back waits for the event loop's thread to let go (up to the switch interval).
_held = ctypes.PyDLL(libllama._name)
_sample = _held.llama_sampler_sample
_sample.argtypes = [lc.llama_sampler_p_ctypes, lc.llama_context_p_ctypes, ctypes.c_int32]
_sample.restype = lc.llama_token
_is_eog = _held.llama_vocab_is_eog
_is_eog.argtypes = [lc.llama_vocab_p_ctypes, lc.llama_token]
_is_eog.restype = ctypes.c_bool

# ggml's own functions, looked up through libllama so that they are those of the ggml that
# libllama uses (a wheel holds each library more than once, as copies, not links).
_abort_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_set_abort_callback = libllama.ggml_set_abort_callback
_set_abort_callback.argtypes = [_abort_type]
_set_abort_callback.restype = ctypes.c_void_p
_load_backends = libllama.ggml_backend_load_all_from_path
_load_backends.argtypes = [ctypes.c_char_p]
_load_backends.restype = None
_abort_handlers: list[Callable[[str], None]] = []


@_abort_type  # type: ignore[untyped-decorator]
def _on_ggml_abort(message: bytes | None) -> None:
    """``GGML_ABORT`` was hit (in any thread): tell the handlers, then llama.cpp aborts."""
    text = (message or b"").decode("utf-8", "replace")
    logger.critical("llama.cpp aborted: %s", text)
    for handler in list(_abort_handlers):
        try:
            handler(text)
        except Exception:  # the process is going down: report, never raise into C
            logger.exception("abort handler failed")


def on_abort(handler: Callable[[str], None]) -> Callable[[], None]:
    """Call ``handler(message)`` when llama.cpp aborts the process; returns the remover.

    It runs in the aborting thread, with llama.cpp stopped there, just before ``abort()``: time
    enough to fail the running requests and report the engine down, not to carry on.
    """
    _abort_handlers.append(handler)
    return lambda: _abort_handlers.remove(handler) if handler in _abort_handlers else None


def runtime_dispatch() -> bool:
    """Whether this llama.cpp build picks its CPU code at run time (``GGML_BACKEND_DL``)."""
    return any(LIBRARY_DIR.glob("*ggml-cpu-*"))


def backend_cwd() -> str | None:
    """The working directory another program on this llama-cpp-python (its own server, say)
    needs to find a runtime-dispatch build's CPU backends (llama.cpp looks there)."""
    return str(LIBRARY_DIR) if runtime_dispatch() else None


def _init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            lc.llama_log_set(_log_to_python, ctypes.c_void_p(0))
            _set_abort_callback(_on_ggml_abort)
            if runtime_dispatch():
                # llama.cpp looks beside the executable and in the working directory only.
                _load_backends(str(LIBRARY_DIR).encode())
            lc.llama_backend_init()
            _backend_ready = True


#: A saved sequence: llama.cpp's own bytes, kept in the buffer they were written to.
State = ctypes.Array[ctypes.c_uint8]


@dataclass(frozen=True, slots=True)
class ContextShape:
    """How a context is laid out: ``n_seq`` sequences of ``n_ctx_seq`` cells each."""

    n_seq: int
    n_ctx_seq: int
    n_batch: int
    threads: int
    flash_attn: str = "auto"  # "auto" (llama.cpp decides: on for the CPU), "on" or "off"


_FLASH_ATTN: Final = {
    "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


def require_model_file(path: Path) -> None:
    """Refuse a model path that is not a readable file, before anything loads it."""
    if not path.is_file():
        raise ConfigError(f"model file not found: {path}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"model file is not readable: {path}")


class LlamaModel:
    """A loaded GGUF model and its vocabulary.

    ``repack`` lets llama.cpp lay the weights out for the CPU's own kernels (its "extra buffer
    types": interleaved blocks, AMX tiles); see :mod:`~seedance.engines.llamacpp.cpu` for when
    that is safe and faster.
    """

    def __init__(self, path: Path, *, repack: bool = False, vocab_only: bool = False) -> None:
        """``vocab_only``: the vocabulary, chat template and hyperparameters, not the weights
        (what counting and rendering prompts needs)."""
        require_model_file(path)
        _init_backend()
        params = lc.llama_model_default_params()
        params.use_extra_bufts = repack
        params.vocab_only = vocab_only
        self.path = path
        self.repack = repack
        self._ptr = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self._ptr:
            raise ConfigError(f"cannot load model file {path}: not a GGUF model llama.cpp reads")
        self._vocab = lc.llama_model_get_vocab(self._ptr)
        self.n_ctx_train: int = lc.llama_model_n_ctx_train(self._ptr)
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)

    @property
    def ptr(self) -> Any:
        return self._ptr

    def close(self) -> None:
        if self._ptr:
            lc.llama_model_free(self._ptr)
            self._ptr = None

    def chat_template(self) -> str | None:
        raw = lc.llama_model_chat_template(self._ptr, None)
        return raw.decode("utf-8", "replace") if raw else None

    def token_text(self, token: int) -> str:
        """A special token's text (``<|im_end|>``), for the chat template's variables."""
        return self._render(token, special=True).decode("utf-8", "replace")

    def bos_token(self) -> int:
        return int(lc.llama_vocab_bos(self._vocab))

    def eos_token(self) -> int:
        return int(lc.llama_vocab_eos(self._vocab))

    def tokenize(self, text: str, *, special: bool, parse_special: bool | None = None) -> list[int]:
        """Tokens of ``text``; with ``special``, BOS is added (where the model wants it) and
        special-token text such as ``<|im_start|>`` becomes those tokens (``parse_special``:
        that alone, whatever ``special`` says)."""
        parse = special if parse_special is None else parse_special
        data = text.encode("utf-8", "surrogatepass")
        room = len(data) + 8
        buf = (lc.llama_token * room)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, room, special, parse)
        if n < 0:  # pragma: no cover - more tokens than bytes + 8 cannot happen
            room = -n
            buf = (lc.llama_token * room)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, room, special, parse)
        return buf[:n]

    @property
    def vocab_size(self) -> int:
        return int(lc.llama_vocab_n_tokens(self._vocab))

    @property
    def vocab(self) -> Any:
        """llama.cpp's vocabulary object (``llama_vocab *``), for libraries that read it."""
        return self._vocab

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (special tokens as their text, as llama.cpp's ``llama-server``
        gives them); ids outside the vocabulary are the caller's to refuse."""
        ids = (lc.llama_token * len(tokens))(*tokens)
        room = max(64, 8 * len(tokens))
        for _ in range(2):
            buf = ctypes.create_string_buffer(room)
            n = lc.llama_detokenize(self._vocab, ids, len(tokens), buf, room, False, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            room = -n
        raise RuntimeError("llama_detokenize did not fit the size it asked for")  # pragma: no cover

    def piece(self, token: int) -> bytes:
        """The bytes a generated token stands for (special tokens: none)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._render(token, special=False)
        return piece

    def is_eog(self, token: int) -> bool:
        return bool(_is_eog(self._vocab, token))

    @functools.cached_property
    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (the tokens ``ignore_eos`` bans)."""
        return tuple(t for t in range(self.vocab_size) if self.is_eog(t))

    def _render(self, token: int, *, special: bool) -> bytes:
        buf = self._piece_buf
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:  # pragma: no cover - pieces longer than 256 bytes
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]


class LlamaContext:
    """One llama.cpp context: ``shape.n_seq`` sequences decoded together, one batch per step.

    Not thread-safe: only the decode thread uses it after construction.
    """

    def __init__(self, model: LlamaModel, shape: ContextShape) -> None:
        params = lc.llama_context_default_params()
        params.n_ctx = shape.n_seq * shape.n_ctx_seq
        params.n_batch = shape.n_batch
        params.n_ubatch = min(512, shape.n_batch)
        params.n_seq_max = shape.n_seq
        params.n_threads = shape.threads
        params.n_threads_batch = shape.threads
        params.kv_unified = False  # each sequence attends over its own cells only
        params.no_perf = True
        params.flash_attn_type = _FLASH_ATTN[shape.flash_attn]
        self.model = model
        self.shape = shape
        self._ptr = lc.llama_init_from_model(model.ptr, params)
        if not self._ptr:
            raise ConfigError(
                f"llama.cpp could not create a context of {params.n_ctx} tokens for "
                f"{model.path} (out of memory?); lower --n-ctx or --parallel"
            )
        self.n_ctx_seq: int = lc.llama_n_ctx_seq(self._ptr)
        self._memory = lc.llama_get_memory(self._ptr)
        self._batch = lc.llama_batch_init(shape.n_batch, 0, 1)
        self.n_tokens = 0

    def close(self) -> None:
        if self._ptr:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ptr)
            self._ptr = None

    # -- batch ---------------------------------------------------------------------------

    def clear_batch(self) -> None:
        self.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token to the batch; returns its index (for :meth:`sample`)."""
        batch, i = self._batch, self.n_tokens
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
        self.n_tokens = i + 1
        return i

    def decode(self) -> int:
        """Run the batch; llama.cpp's return code (0: success)."""
        self._batch.n_tokens = self.n_tokens
        return int(lc.llama_decode(self._ptr, self._batch))

    # -- sequences -----------------------------------------------------------------------

    def forget(self, seq: int, start: int = 0) -> bool:
        """Drop the cells of ``seq`` from position ``start`` on."""
        return bool(lc.llama_memory_seq_rm(self._memory, seq, start, -1))

    def state_size(self, seq: int) -> int:
        return int(lc.llama_state_seq_get_size(self._ptr, seq))

    def save_state(self, seq: int) -> State:
        """The KV cells of ``seq`` (see :meth:`load_state`)."""
        size = self.state_size(seq)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data(self._ptr, buf, size, seq)
        if written != size:  # pragma: no cover - llama.cpp sized it itself
            raise RuntimeError(f"saved {written} of {size} bytes of sequence {seq}")
        return buf

    def load_state(self, seq: int, state: State) -> bool:
        """Put saved cells back into ``seq`` (which must be empty)."""
        return bool(lc.llama_state_seq_set_data(self._ptr, state, len(state), seq))

    # -- sampling ------------------------------------------------------------------------

    def logits(self, index: int) -> npt.NDArray[np.float32]:
        """The logits of batch entry ``index`` (after :meth:`decode`), as a writable view of
        llama.cpp's own buffer: what the sampler reads next."""
        pointer = lc.llama_get_logits_ith(self._ptr, index)
        return np.ctypeslib.as_array(pointer, shape=(self.model.vocab_size,))

    def sample(self, sampler: Sampler, index: int) -> int:
        """Sample from the logits of batch entry ``index`` (and accept the token)."""
        return int(_sample(sampler.ptr, self._ptr, index))


class Sampler:
    """A llama.cpp sampler chain for one request: temperature, top-p, seeded draw (and
    ``banned`` tokens never drawn: a logit bias of minus infinity first)."""

    __slots__ = ("ptr",)

    def __init__(
        self,
        *,
        temperature: float,
        top_p: float,
        seed: int,
        vocab_size: int = 0,
        banned: Sequence[int] = (),
    ) -> None:
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if banned:
            biases = (lc.llama_logit_bias * len(banned))(
                *(lc.llama_logit_bias(token, -math.inf) for token in banned)
            )
            bias = lc.llama_sampler_init_logit_bias(vocab_size, len(banned), biases)
            lc.llama_sampler_chain_add(chain, bias)
        if temperature <= 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        else:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temperature))
            if top_p < 1.0:
                lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(top_p, 1))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        self.ptr = chain

    def close(self) -> None:
        if self.ptr:
            lc.llama_sampler_free(self.ptr)
            self.ptr = None
