"""Former name of :mod:`pagedkv.capacity` (the capacity planner behind ``pagedkv plan``).

Kept so that existing imports (``pagedkv.plan.kv_heads_per_rank``, ``pagedkv.plan.shard_spec``,
...) keep working; it defines nothing of its own. New code imports :mod:`pagedkv.capacity`.
"""

from .capacity import *  # noqa: F401,F403
from .capacity import __all__  # noqa: F401
