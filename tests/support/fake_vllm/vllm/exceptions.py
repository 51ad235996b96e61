"""vLLM's exceptions module: from 0.14; ``VLLMClientError`` from 0.27."""

from vllm import version

if version() < (0, 14):
    raise ImportError("No module named 'vllm.exceptions'")


class VLLMError(Exception):
    pass


class VLLMClientError(VLLMError):
    pass


if version() < (0, 27):

    class VLLMValidationError(ValueError):  # type: ignore[no-redef]
        pass

    del VLLMClientError  # not there yet

else:

    class VLLMValidationError(VLLMClientError):  # type: ignore[no-redef]
        pass
