"""The reference engine: model loading, the model runner over the paged KV pool, and the offline API."""
