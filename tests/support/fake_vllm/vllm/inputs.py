"""Token prompts: ``TokensPrompt`` always, ``tokens_input`` from 0.19."""

from typing import Any

from vllm import version


def TokensPrompt(*, prompt_token_ids: list[int]) -> dict[str, Any]:  # a TypedDict in vLLM
    return {"prompt_token_ids": prompt_token_ids}


def _tokens_input(prompt_token_ids: list[int]) -> dict[str, Any]:
    return {"type": "token", "prompt_token_ids": prompt_token_ids}


def __getattr__(name: str) -> Any:
    if name == "tokens_input" and version() >= (0, 19):
        return _tokens_input
    raise AttributeError(name)
