"""Tiny random models of the attention families KV cache groups serve, saved to a directory.

Shared by the tests of hybrid models (the engine, the host tier, tensor parallelism, KV events):
each family's config at one small shape (hidden 32, 4 query heads over 2 KV heads of 16, a
window or chunk of :data:`WINDOW`, context :data:`MAX_LEN`, vocabulary :data:`VOCAB`), the
weights drawn from a seed with biases and attention sinks (zero at init) made to matter, and
transformers' own greedy ``generate`` as the reference the engine is held to.
"""

from __future__ import annotations

from typing import Any, List

VOCAB = 128
WINDOW = 8
MAX_LEN = 256

#: The shape every family shares (a test may build another family at it).
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_LEN,
               initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None,
               tie_word_embeddings=False)


def hybrid_config(kind: str) -> Any:
    """The transformers config of ``kind``: ``gemma3_text`` (three sliding layers, one full),
    ``gpt_oss`` (sliding and full, sinks, top-2 of 4 experts), ``qwen3`` / ``qwen2`` (sliding
    above ``max_window_layers``), ``mistral`` (every layer slides), ``llama4_text`` (chunked and
    NoPE layers, experts)."""
    import transformers

    if kind == "gemma3_text":
        return transformers.Gemma3TextConfig(
            num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], **COMMON)
    if kind == "gpt_oss":
        common = dict(COMMON, intermediate_size=32)
        return transformers.GptOssConfig(
            num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], **common)
    if kind == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=3, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=1, **COMMON)
    if kind == "qwen2":
        return transformers.Qwen2Config(num_hidden_layers=3, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=2, **COMMON)
    if kind == "mistral":
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **COMMON)
    if kind == "llama4_text":
        common = dict(COMMON, intermediate_size=32)
        # floor_scale 4: the NoPE layers' query temperature varies within these short prompts.
        return transformers.Llama4TextConfig(
            num_hidden_layers=4, attention_chunk_size=WINDOW, intermediate_size_mlp=64,
            num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
            floor_scale=4, **common)
    raise AssertionError(kind)


def save_hybrid(kind: str, directory: str, *, seed: int = 1234) -> str:
    """Saves a random ``kind`` model (:func:`hybrid_config`, weights from ``seed``) to
    ``directory`` and returns it. Biases and sinks, zero at init, are drawn too so they matter."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hybrid_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "sinks" in name:
                p.normal_(0.0, 0.5 if "sinks" in name else 0.1)
    model.save_pretrained(directory)
    return directory


def greedy_reference(dense: Any, prompt: List[int], max_new_tokens: int) -> List[int]:
    """transformers' own greedy ``generate`` of ``max_new_tokens`` after ``prompt``."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = dense.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return list(out[0, len(prompt):].tolist())
