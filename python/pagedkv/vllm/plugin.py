"""The ``vllm.general_plugins`` entry point (kept separate so vLLM loads nothing else)."""

from pagedkv.vllm import register

__all__ = ["register"]
