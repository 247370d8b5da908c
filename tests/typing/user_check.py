"""A user's program touching every public name of ``pagedkv``, the way the README does.

``tests/test_typing.py`` runs ``mypy --strict`` on this file (it must type-check without a single
``type: ignore``) and then runs it. Each annotation below is the type a user would write; a stub or
re-export regression shows up as a mypy error here rather than in someone's CI.
"""

from __future__ import annotations

import os
from typing import List, Optional

import numpy as np

import pagedkv
from pagedkv import errors


def manager_flow() -> pagedkv.Stats:
    m = pagedkv.BlockManager(num_blocks=64, block_size=16, watermark_blocks=0)
    bufs = pagedkv.StepBuffers(max_seqs=8, max_tokens=512, max_blocks_per_seq=m.max_blocks_per_seq,
                               device="cpu")
    m.attach_buffers(bufs)

    r: pagedkv.AdmitResult = m.admit(1, np.arange(100), cache_salt=b"tenant-a")
    cached: int = r.cached_tokens
    held: int = r.num_tokens
    assert held == 100
    info: pagedkv.StepInfo = m.step([1], [100 - cached])
    assert info.num_tokens == 100 - cached and info.max_seq_len == 100
    m.fork(1, 2)
    m.append_batch([1, 2], [7, 8])
    info = m.step([1, 2], 1)
    tensors: pagedkv.StepTensors = bufs.to_device(info)
    slots = tensors.slot_mapping[: info.num_tokens].tolist()
    assert len(slots) == 2
    table: list[int] = m.block_table(1)
    assert len(table) == 7 and m.seq_len(2) == 101
    stats = m.stats()
    ratio: float = stats.prefix_hit_ratio
    assert 0.0 <= ratio <= 1.0
    m.free_batch([1, 2])
    m.check_invariants()
    return stats


def pool_flow() -> int:
    spec = pagedkv.CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
    per_token: int = spec.bytes_per_token
    pool = pagedkv.KVPool(spec, num_blocks=4)
    k, v = pool.block_view(0, 1)
    assert tuple(k.shape) == tuple(v.shape) == (16, 2, 8)
    copied: int = pool.copy_blocks([(1, 2)])
    assert copied == 1
    return per_token


def errors_flow() -> list[str]:
    m = pagedkv.BlockManager(num_blocks=4, block_size=16, watermark_blocks=0)
    seen: list[str] = []
    try:
        m.free(99)
    except pagedkv.UnknownSequenceError as err:
        seq: int = err.seq_id
        seen.append(f"{type(err).__name__}({seq})")
    m.admit(1, [1, 2, 3])
    try:
        m.admit(1, [4])
    except pagedkv.DuplicateSequenceError as err:
        seen.append(f"{type(err).__name__}({err.seq_id})")
    try:
        m.admit(2, list(range(16 * 4)))  # 4 blocks; 3 are free
    except pagedkv.WatermarkReachedError as err:
        seen.append(f"{type(err).__name__}({err.needed}, {err.available}, {err.watermark})")
    except pagedkv.OutOfBlocksError as err:
        needed: int = err.needed
        available: int = err.available
        seen.append(f"{type(err).__name__}({needed}, {available})")
    try:
        m.block_refcount(1000)
    except pagedkv.InvalidBlockError as err:
        block: int = err.block
        seen.append(f"{type(err).__name__}({block} of {err.num_blocks})")
    try:
        pagedkv.BlockManager(num_blocks=0)
    except pagedkv.InvalidConfigError as err:
        name: Optional[str] = err.field
        seen.append(f"{type(err).__name__}({name})")
    try:
        m.admit(3, [-1])
    except pagedkv.InvalidArgumentError as err:
        what: str = err.what
        reason: str = err.reason
        seen.append(f"{type(err).__name__}({what}: {reason})")
    try:
        pagedkv.BlockManager(num_blocks=4).step([], [])
    except pagedkv.BuffersNotRegisteredError as err:
        seen.append(type(err).__name__)
    except pagedkv.PagedKVError as err:
        seen.append(f"unexpected {err!r}")
    return seen


def error_classes() -> list[type[pagedkv.PagedKVError]]:
    # The rest are raised on paths a user cannot provoke cheaply; a handler for each still has to
    # type-check, fields included.
    def describe(err: pagedkv.PagedKVError) -> str:
        if isinstance(err, pagedkv.SequenceTooLongError):
            return f"{err.seq_id} {err.needed_blocks} {err.max_blocks_per_seq}"
        if isinstance(err, pagedkv.BufferTooSmallError):
            return f"{err.buffer} {err.needed} {err.capacity}"
        if isinstance(err, pagedkv.BufferInvalidError):
            return f"{err.buffer} {err.expected} {err.got}"
        if isinstance(err, (pagedkv.RefcountUnderflowError, pagedkv.PrefixCollisionError)):
            return str(err.block)
        if isinstance(err, pagedkv.InvariantViolationError):
            return err.detail
        if isinstance(err, errors.MissingDependencyError):
            return f"{err.module} {err.extra}"
        return err.message

    classes: list[type[pagedkv.PagedKVError]] = [
        pagedkv.SequenceTooLongError, pagedkv.BufferTooSmallError, pagedkv.BufferInvalidError,
        pagedkv.RefcountUnderflowError, pagedkv.PrefixCollisionError, pagedkv.InvariantViolationError,
    ]
    assert describe(pagedkv.InvariantViolationError("x", detail="d")) == "d"
    return classes


def engine_flow(model: Optional[str] = None) -> list[str]:
    """The README's engine example. Type-checked always; run only on request (it loads a model)."""
    llm = pagedkv.LLM(model, device="cpu", num_blocks=256, progress=False)
    params = pagedkv.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4, n=2, seed=0)
    outs: list[pagedkv.RequestOutput] = llm.generate(["The capital of France is", [1, 4093, 198]],
                                                      params, use_tqdm=False)
    texts: list[str] = []
    for out in outs:
        request_id: str = out.request_id
        for c in out.outputs:
            completion: pagedkv.CompletionOutput = c
            reason: Optional[str] = completion.finish_reason
            texts.append(f"{request_id} {completion.index} {reason} {completion.text!r}")
    engine = pagedkv.LLMEngine(model, device="cpu", num_blocks=256)
    engine.add_request("r0", [1, 2, 3], pagedkv.SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        for done in engine.step():
            texts.append(done.request_id)
    try:
        pagedkv.LLM("/nonexistent/model")
    except pagedkv.PagedKVError as err:
        texts.append(err.message)
    return texts


def chat_flow(model: Optional[str] = None) -> list[str]:
    """Chat and vLLM's sampling options, as a vLLM user writes them. Type-checked always; run
    only on request (it loads a model)."""
    llm = pagedkv.LLM(model, device="cpu", num_blocks=256, progress=False)
    params = pagedkv.SamplingParams(temperature=0.7, seed=1, max_tokens=8, stop=["\n\n"],
                                    min_tokens=1, logprobs=2, presence_penalty=0.5,
                                    frequency_penalty=0.2, repetition_penalty=1.1, min_p=0.05,
                                    output_kind=pagedkv.RequestOutputKind.FINAL_ONLY)
    messages = [{"role": "user", "content": "Say hi."}]
    out: pagedkv.RequestOutput = llm.chat(messages, params, use_tqdm=False)[0]
    seen = [out.outputs[0].text]
    for position in out.outputs[0].logprobs or []:
        for token_id, lp in position.items():
            entry: pagedkv.Logprob = lp
            rank: Optional[int] = entry.rank
            seen.append(f"{token_id} {entry.logprob:.3f} {rank} {entry.decoded_token!r}")
    cumulative: Optional[float] = out.outputs[0].cumulative_logprob
    seen.append(repr(cumulative))
    return seen


async def async_flow(model: Optional[str] = None) -> list[str]:
    """AsyncLLM as docs/serve.md shows it. Type-checked always; run with the engine flow."""
    llm = pagedkv.AsyncLLM(model, device="cpu", num_blocks=256, max_queue_size=8)
    texts: list[str] = []
    try:
        params = pagedkv.SamplingParams(temperature=0.0, max_tokens=2)
        async for out in llm.generate([1, 2, 3], params, request_id="a0"):
            snapshot: pagedkv.RequestOutput = out
            texts.append(snapshot.outputs[0].text)
        aborted: bool = await llm.abort("a0")
        assert not aborted
        try:
            async for _ in llm.generate("", params):
                pass
        except errors.InvalidArgumentError as err:
            texts.append(err.reason)
        except errors.EngineOverloadedError as err:
            texts.append(f"{err.waiting}/{err.max_queue_size}")
    finally:
        llm.shutdown()
    return texts


def allocation_failure(err: pagedkv.AllocationFailedError) -> str:
    what: str = err.what
    size: int = err.bytes
    return f"{what}: {size} bytes"


def swap_flow() -> list[str]:
    m = pagedkv.BlockManager(num_blocks=16, block_size=4, watermark_blocks=0, num_host_blocks=2)
    m.cost_model = pagedkv.CostModel(host_link_bytes_per_s=50e9, prefill_tokens_per_s=20e3,
                                     kv_bytes_per_token=1024.0)
    m.admit(1, list(range(12)))
    d: pagedkv.Decision = m.decide([1])
    seen = [d.mode]
    try:
        m.swap_out([1])
    except pagedkv.OutOfHostBlocksError as err:
        needed: int = err.needed
        seen.append(f"host {needed}>{err.available}")
    m.recompute(1)
    try:
        m.recompute(1)
    except pagedkv.InvalidSequenceStateError as err:
        state: str = err.state
        seen.append(f"{err.seq_id} {state} {err.expected}")
    return seen


def hash_flow() -> List[int]:
    """The hashes a router computes for a prompt (the replicas' key, a tenant's salt)."""
    hashes: List[int] = pagedkv.hash_prompt([1, 2, 3, 4, 5, 6, 7, 8], 4, key=7, salt="tenant-a")
    return hashes


def groups_flow() -> List[int]:
    """A hybrid model's manager: a full group beside a sliding-window one."""
    groups = [pagedkv.KVCacheGroup.full(), pagedkv.KVCacheGroup.sliding(8)]
    m = pagedkv.BlockManager(num_blocks=32, block_size=4, watermark_blocks=0, groups=groups)
    bufs = pagedkv.StepBuffers(max_seqs=2, max_tokens=64, max_blocks_per_seq=16, device="cpu",
                               num_groups=m.num_groups)
    m.attach_buffers(bufs)
    m.admit(1, list(range(20)))
    m.step([1], [20])
    m.append(1, [20])
    info = m.step([1], 1)  # computes position 20: the window of 8 reads [13, 20]
    assert bufs.group_views(info, 1, on_device=False).slot_mapping.shape[0] == 1
    kind: pagedkv.KVCacheGroup = m.groups[1]
    assert kind.size == 8
    sliding: List[int] = m.block_table(1, group=1)
    return sliding


def main() -> None:
    version: str = pagedkv.__version__
    assert version
    stats = manager_flow()
    assert stats.num_blocks == 64
    assert pool_flow() == 2 * 2 * 8 * 4 * 2
    seen = errors_flow()
    assert len(seen) == 7, seen
    assert len(error_classes()) == 6
    assert allocation_failure(pagedkv.AllocationFailedError("x", what="pool", bytes=8)) == "pool: 8 bytes"
    assert len(swap_flow()) == 3
    assert len(hash_flow()) == 2
    sliding = groups_flow()
    assert sliding[:3] == [-1, -1, -1] and -1 not in sliding[3:]
    if os.environ.get("PAGEDKV_USER_CHECK_ENGINE"):
        assert len(engine_flow()) >= 5
        import asyncio

        assert len(asyncio.run(async_flow())) >= 2
        assert len(chat_flow()) >= 2


if __name__ == "__main__":
    main()
