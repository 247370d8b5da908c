"""What the tensor-parallel tests share: the module-level requirements, the prompts and sampling
parameters that exercise a chunked prefill, a prefix-cache hit and a fork, one ``LLM.generate`` run
at a given ``tensor_parallel_size`` (rank 0 here, the other ranks spawned over gloo or NCCL,
each recording its step packets), the checks that a TP run followed the TP=1 run's schedule, and a
real gloo process group of one rank for checking step packets in this process.

:func:`require_torch_distributed` is called at import time by a test module: it skips the module
unless torch, transformers and ``torch.distributed`` are available, and keeps the hub offline.
Nothing here imports the engine before it is needed.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest


def require_torch_distributed() -> Any:
    """Skips the calling test module without torch, transformers or ``torch.distributed``; sets
    the hub offline (as a default); returns ``torch``."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("torch.distributed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not torch.distributed.is_available():  # pragma: no cover
        pytest.skip("torch.distributed is not available", allow_module_level=True)
    return torch


def prompts(vocab: int, second: int, shared: int) -> List[List[int]]:
    """Five prompts over ``vocab``: 5 tokens, ``second`` tokens, a 70-token ``base`` (prefilled in
    chunks under a 32-token budget), ``base[:shared]`` plus three tokens (a prefix-cache hit of
    ``shared // block_size`` full blocks), and 14 tokens."""
    base = [(7 * j + 3) % vocab for j in range(70)]
    return [
        [(5 * j + 1) % vocab for j in range(5)],
        [(11 * j + 2) % vocab for j in range(second)],
        base,
        base[:shared] + [9, 8, 7],
        [(13 * j + 4) % vocab for j in range(14)],
    ]


def params() -> List[Any]:
    """Greedy, 24 tokens each, ignoring EOS; the second prompt with ``n=2`` (a fork, so
    copy-on-write lists)."""
    from pagedkv.engine.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    forked = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    return [greedy, forked, greedy, greedy, greedy]


def generate(path: str, tp: int, engine: Dict[str, Any], prompt_ids: List[List[int]],
             sampling: List[Any], *,
             check: Optional[Callable[[Any], None]] = None) -> Tuple[List[Any], Any, Any]:
    """Runs ``prompt_ids`` through ``LLM(path, **engine)``, with ``tensor_parallel_size=tp`` and
    every rank recording its steps when ``tp > 1``; ``check(llm)`` (if given) runs on the built
    engine first. Returns each request's token ids per completion, the stats and the step records
    (None at ``tp == 1``); the engine is shut down whatever happens."""
    from pagedkv.engine.llm import LLM

    args = dict(engine)
    if tp > 1:
        args.update(tensor_parallel_size=tp, record_steps=True, tp_timeout_s=120)
    llm = LLM(path, **args)
    try:
        if check is not None:
            check(llm)
        outs = llm.generate(prompt_ids, sampling, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    return tokens, stats, llm.llm_engine.tp_step_records


def check_same_schedule(ref: Tuple[List[Any], Any, Any], got: Tuple[List[Any], Any, Any]) -> None:
    """A TP run (``got``) against the TP=1 run (``ref``), both from :func:`generate`: the same
    tokens, the same number of steps and preemptions (at least one), and a prefix-cache hit."""
    (ref_tokens, ref_stats, _), (tokens, stats, _) = ref, got
    assert tokens == ref_tokens
    assert stats.num_steps == ref_stats.num_steps
    assert stats.num_preemptions == ref_stats.num_preemptions > 0
    assert stats.prefix_hit_tokens > 0


def check_full_chunk_and_copies(infos: List[Any], max_num_batched_tokens: int) -> None:
    """Rank 0's recorded step infos (``seqs, tokens, kv_indices, copies, ...``): one step ran a
    full prefill chunk, and one broadcast a copy-on-write list."""
    assert max(i[1] for i in infos) == max_num_batched_tokens  # a full prefill chunk
    assert any(i[3] > 0 for i in infos), "no copy-on-write list was broadcast"


@pytest.fixture
def gloo_world_of_one(tmp_path: Any) -> Iterator[Any]:
    """A real gloo process group of one rank (its broadcast leaves the packet as it is), torn
    down afterwards so later tests see no group."""
    import torch.distributed as dist

    from pagedkv.distributed.tp import TPGroup

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield TPGroup()
    finally:
        dist.destroy_process_group()
