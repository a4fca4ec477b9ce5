"""Small Hugging Face Llama directories, saved by ``transformers`` (the reference for the layout)."""

from __future__ import annotations

from pathlib import Path


def save_small_llama(path: Path, vocab_size: int = 256, seed: int = 0) -> Path:
    """A random 2-layer Llama (GQA, width 64) saved with ``save_pretrained`` at ``path``; returns ``path``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=vocab_size,
                                      rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return Path(path)
