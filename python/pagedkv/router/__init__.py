"""The reference prefix-aware router (``pagedkv router``): places OpenAI requests on the replica
whose published KV cache holds the longest prefix of the prompt (``docs/router.md``).

Owns :class:`PrefixIndex` (:mod:`.index`) and :class:`Router` / :func:`build_app`
(:mod:`.app`). Needs ``pagedkv[router]``.
"""

from __future__ import annotations

from .app import ReplicaSpec, Router, build_app
from .index import PrefixIndex

__all__ = ["PrefixIndex", "ReplicaSpec", "Router", "build_app"]
