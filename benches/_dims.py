"""Model dimensions shared by the benchmark scripts: one set of flags, Llama-3-8B's by default.

Owns the dimension flags (``--layers --hidden --heads --kv-heads --mlp --vocab``), their
Llama-3-8B defaults, and the random-weight ``transformers.LlamaConfig`` the benches build from
them, so every script that builds a model states and reads its dimensions the same way. Scripts
import it as ``_dims`` (the benches directory is the script's own, first on ``sys.path``).
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

#: Llama-3-8B: 32 layers, hidden 4096, 32 query / 8 KV heads (head_dim 128), MLP 14336.
LLAMA3_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "mlp": 14336,
             "vocab": 128256}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """Adds the dimension flags, defaulting to :data:`LLAMA3_8B`."""
    for name, default in LLAMA3_8B.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def model_dims(args: argparse.Namespace) -> dict[str, int]:
    """The dimensions ``args`` carries (after :func:`add_model_args` and any overrides)."""
    return {name: getattr(args, name) for name in LLAMA3_8B}


def llama_config(dims: Mapping[str, int], max_model_len: int) -> Any:
    """A ``transformers.LlamaConfig`` of ``dims`` with Llama-3's RoPE base, untied embeddings and
    no special tokens (the benches feed token ids and stop on length)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=dims["vocab"], hidden_size=dims["hidden"], intermediate_size=dims["mlp"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], max_position_embeddings=max_model_len,
        rope_theta=500000.0, initializer_range=0.02, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False,
    )
