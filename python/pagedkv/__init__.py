"""pagedkv: a paged KV cache for LLM serving."""
