"""Hugging Face model folders made from the embedded SmolLM2 GGUF, with no download: its
tokenizer and chat template, and a tiny Llama with random weights around them (for the vLLM
engine's tests and ``make gpu-smoke``)."""

from __future__ import annotations

from pathlib import Path

from seedance.engines.local import default_model_path


def smollm2_tokenizer(folder: Path) -> Path:
    """SmolLM2's tokenizer and chat template, read from the GGUF, saved in ``folder``."""
    from transformers import AutoTokenizer

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_llama(folder: Path, *, layers: int = 2, hidden: int = 256, seed: int = 0) -> Path:
    """A Llama of 2 layers with random weights and SmolLM2's vocabulary (13 million
    parameters, mostly the embeddings; heads of 64, which every vLLM attention backend takes),
    saved in ``folder`` with the tokenizer: any engine loads it, and its replies are nonsense."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    smollm2_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(folder)
    return folder
