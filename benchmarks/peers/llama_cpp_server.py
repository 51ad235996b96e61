"""llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``, unchanged), with
one setting its command line lacks: ``--no-repack`` loads the model without llama.cpp's
repacked weight layouts (``use_extra_bufts``), as ``llama-server --no-repack`` does.

Where the repacked layout kills the process (a VM that reports AMX without enabling its state:
SIGILL at the first reply), the peer would otherwise die under its first request. Callers pass
the flag when the llamacpp engine's probe (``--repack auto``) decided against the layout on this
machine, so both servers run the weights the same way.

    python -m benchmarks.peers.llama_cpp_server --no-repack --model M.gguf --port 8001
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> None:
    if "--no-repack" in sys.argv:
        sys.argv.remove("--no-repack")
        from llama_cpp import llama_cpp as lc

        defaults = lc.llama_model_default_params

        def without_repacking() -> Any:
            params = defaults()
            params.use_extra_bufts = False
            return params

        lc.llama_model_default_params = without_repacking  # read by Llama() as it loads
    from llama_cpp.server.__main__ import main as serve

    sys.argv[0] = "llama_cpp.server"
    serve()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
