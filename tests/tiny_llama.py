"""A tiny random Llama with a word-level tokenizer and a chat template, saved to a directory.

Shared by the async-engine and server tests: it loads in about a second through the engine's real
loader, so a test can build a server around it. Token ``i`` is the word ``"w<i>"`` (text round-trips
exactly); ids 1 and 2 frame chat turns, so a conversation's content must be such words too.
"""

from __future__ import annotations

from typing import Optional

VOCAB = 128

CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w2{% endif %}"
)


def save_tiny_llama(directory: str, max_len: int = 256, *, seed: int = 1234,
                    chat_template: Optional[str] = CHAT_TEMPLATE) -> str:
    """Saves the model and its tokenizer (with ``chat_template``, none if None) to ``directory``;
    ``seed`` draws the weights."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
        initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return directory
