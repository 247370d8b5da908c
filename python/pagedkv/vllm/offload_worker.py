"""The worker side of :class:`pagedkv.vllm.offload.PagedKVOffloadingSpec`: vLLM's
``OffloadingWorker`` over pagedkv's chunk copier (:mod:`pagedkv.vllm.offload_copy`).

Owns :class:`PagedKVOffloadingWorker`, which vLLM's ``OffloadingConnector`` builds in every
worker process with that process's KV cache tensors (``CanonicalKVCaches``: block-major tensors
and, per KV cache group, the tensors its layers use). It allocates the host pool (pinned when the
tensors are on CUDA) and turns vLLM's transfer specs into the copier's ids: ``submit_store``
(GPU blocks -> host chunks), ``submit_load`` (host chunks -> GPU blocks), ``get_finished``
(completed jobs, once each, as vLLM's ``TransferResult``), ``wait``.

Invariants: a job is reported finished only after its copies have completed on the device; a
rejected submit (bad ids, counts that do not add up) raises
:class:`~pagedkv.errors.InvalidArgumentError` and queues nothing. Expedited loads share the load
stream (they are not reordered ahead of earlier loads). The canonical (parallelism-free) host
layout is not provided: a spec asking for it is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm.offload_copy import ChunkCopier

__all__ = ["PagedKVOffloadingWorker"]


class PagedKVOffloadingWorker(OffloadingWorker):
    """vLLM's worker-side offloading handler on pagedkv's copier (module docs).

    Args:
        kv_caches: The worker's KV caches as vLLM hands them over.
        blocks_per_chunk: GPU blocks per host chunk.
        num_chunks: Host chunks (the manager's).
        pin_memory: As in :class:`~pagedkv.vllm.offload_copy.ChunkCopier`.
        staging_chunks: As in :class:`~pagedkv.vllm.offload_copy.ChunkCopier`.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, *, blocks_per_chunk: int, num_chunks: int,
                 pin_memory: Optional[bool] = None,
                 staging_chunks: Optional[int] = None) -> None:
        tensors = [t.tensor.view(torch.uint8).view(-1, t.page_size_bytes)
                   for t in kv_caches.tensors]
        groups = [[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs]
        self.copier = ChunkCopier(tensors, groups, blocks_per_chunk=blocks_per_chunk,
                                  num_chunks=num_chunks, pin_memory=pin_memory,
                                  staging_chunks=staging_chunks)

    @staticmethod
    def _ids(spec: LoadStoreSpec, what: str) -> Any:
        if not isinstance(spec, BlockIDsLoadStoreSpec):
            raise InvalidArgumentError(
                f"invalid argument: {what} is a {type(spec).__name__}, not a block-id spec",
                what=what, value=type(spec).__name__, reason="must list block ids")
        return spec.block_ids

    @staticmethod
    def _gpu(spec: LoadStoreSpec, what: str) -> GPULoadStoreSpec:
        if not isinstance(spec, GPULoadStoreSpec):
            raise InvalidArgumentError(
                f"invalid argument: {what} is a {type(spec).__name__}, not a GPULoadStoreSpec",
                what=what, value=type(spec).__name__, reason="must be a GPULoadStoreSpec")
        return spec

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        gpu = self._gpu(src_spec, "src_spec")
        self.copier.store(job_id, gpu.block_ids, gpu.group_sizes, gpu.block_indices,
                          self._ids(dst_spec, "dst_spec"))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        gpu = self._gpu(dst_spec, "dst_spec")
        self.copier.load(job_id, self._ids(src_spec, "src_spec"), gpu.block_ids,
                         gpu.group_sizes, gpu.block_indices)
        return True

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(job_id=f.job_id, success=True, transfer_size=f.nbytes,
                               transfer_time=f.seconds) for f in self.copier.finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids)

    def shutdown(self) -> None:
        self.copier.synchronize()
