"""Former name of :mod:`pagedkv.kv_pool` (the device tensors holding every block's K and V).

Kept so that existing imports (``from pagedkv.pool import KVPool``) keep working; it defines
nothing of its own. New code imports :mod:`pagedkv.kv_pool`, or ``pagedkv.KVPool``.
"""

from .kv_pool import *  # noqa: F401,F403
from .kv_pool import __all__  # noqa: F401
