"""Tensor parallelism over torch.distributed: sharded models and pools, one block manager.

Every rank holds the same blocks for its own KV heads (``kv_heads / tp`` of them, or one
replicated head when there are fewer heads than ranks), so one manager on rank 0 decides and each
step's tables are broadcast, as one packet, into every rank's step buffers. See ``docs/tp.md``.

* :mod:`.tp`: :func:`head_split`, :class:`TPGroup`, :func:`shard_model`;
* :mod:`.step_broadcast`: :class:`StepBroadcaster`, the per-step packet;
* :mod:`.launch`: spawning ranks (``LLM(..., tensor_parallel_size=N)``) or joining a group that
  ``torchrun`` made.

Importing this package imports torch.
"""

from .step_broadcast import CMD_END, CMD_STEP, CMD_STOP, StepBroadcaster
from .tp import HeadSplit, RowParallelLinear, TPGroup, head_split, init_group, shard_model

__all__ = ["HeadSplit", "head_split", "TPGroup", "init_group", "shard_model",
           "RowParallelLinear", "StepBroadcaster", "CMD_STEP", "CMD_END", "CMD_STOP"]
