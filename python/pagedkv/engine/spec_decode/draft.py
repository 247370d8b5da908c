"""Draft-model proposer: a smaller model of the target's vocabulary drafts ``k`` tokens per
sequence, with its KV in the same block manager as the target's.

Owns :func:`load_draft` (loading and checking the draft against the target), :func:`draft_spec`,
:func:`build_draft_runner` and :class:`DraftModelProposer`.

The design: the draft runs through its own :class:`~pagedkv.engine.model_runner.ModelRunner`
whose KV pool has the target's block count and block size and is indexed by the *same block ids*
(its own layers, heads and head dim). Every block table, slot, prefix-cache hit, copy-on-write
copy, swap and commit or rewind the manager makes serves both models at once; the pool is sized
by the bytes of a block in both (:func:`draft_spec`). Each engine step, before the target's
forward, :meth:`DraftModelProposer.draft_step`:

1. applies the step's swap lists and copy-on-write pairs to the draft's pool (its own host pool
   for swaps, same host block ids);
2. runs one draft forward over every row's known tokens — prefill chunks, admissions, each
   decode's last token — exactly the slots the target computes for them, and reads the decodes'
   logits there: the first draft of each drafted sequence;
3. runs single-token forwards over the drafts, writing their KV into the provisional slots the
   scheduler gave them, to draw the next draft, and one more for the last draft's KV.

So the draft computes its KV at exactly the positions the target computes, in the same step:
between steps every committed position of every sequence holds both models' KV, accepted drafts
included (the rejected ones are rewound with the target's), and a prefix-cache hit, a fork or a
re-admission after preemption is as good for the draft as for the target. No per-sequence catch-up
state exists; the price is one draft forward per step more than the ``k`` a draft needs when the
last draft's KV is computed lazily, bought so that no committed (hence cacheable) position ever
lacks draft KV.

Draws: a greedy request's draft is the argmax of the draft's logits after the sampler's own
processing (``min_tokens``, penalties with the drafts before it as history); a sampled request's is
drawn from the draft's processed and filtered distribution ``q`` (temperature, min-p, top-k,
top-p), which goes to verification in :attr:`~.base.Drafts.probs` so rejection sampling keeps the
target's distribution exactly. The draft's randomness for output token ``i`` comes from a
generator seeded by the sample's seed (salted) and ``i`` only, so a seeded request stays
reproducible whatever it is batched with.

Refused, with :class:`~pagedkv.errors.ConfigArgumentError` naming ``speculative_config.model``:
a missing path, a vocabulary size other than the target's (both named), a draft or target whose
layers form several KV cache groups or a target with sliding or chunked layers (their tables
release blocks the other model may still read), and the disk and remote tiers of the prefix cache
(their records hold the target's KV only). The host tier serves a draft model: its loads and
demotions are the step's swap lists, applied to both models' host pools, each host block sized for
both models' KV. The draft always runs in the target's dtype, on its device, with its
block size (one pool index serves both), so none of them is a setting. A draft whose context is
shorter than the target's caps the engine's ``max_model_len``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...buffers import StepInfo
from ...config import CacheSpec
from ...errors import ConfigArgumentError
from ..sampler import SamplerRow, filter_logits, process_logits, token_seed
from .base import Drafts, Proposer, clamp_limits
from .config import SpeculativeConfig

__all__ = ["DraftModelProposer", "load_draft", "draft_spec", "build_draft_runner"]

log = logging.getLogger("pagedkv")

#: Salt of the draft's generator seeds (verification draws with the unsalted seed).
DRAFT_SEED_SALT = 0x5EED_D2AF_7000_0001

#: Engine settings a draft model cannot serve: the prefix-cache tiers below the host (their records
#: hold the target's KV only). The host tier serves it: its blocks move by the step's swap lists,
#: which the draft applies to its own host pool.
_TIER_FIELDS = ("disk_cache_dir", "remote_cache_url")


def _bad(value: Any, reason: str, key: str = "model") -> ConfigArgumentError:
    name = f"speculative_config.{key}"
    return ConfigArgumentError(f"invalid config: {name} = {value!r}: {reason}", field=name,
                               value=value, reason=reason)


def _kinds_text(kinds: Sequence[Any]) -> str:
    return ", ".join(sorted({k.kind + (f"({k.size})" if k.size else "") for k in kinds}))


def load_draft(config: Any, target: Any) -> Tuple[Any, Any]:
    """Loads the draft model of ``config.speculative`` beside the loaded ``target`` and checks
    them against each other (module docs).

    Returns:
        ``(target, draft)``: ``target`` with ``max_model_len`` capped at the draft's context when
        that is shorter (a copy; else ``target`` itself), and the draft
        (:class:`~pagedkv.engine.loader.LoadedModel`, no tokenizer, on the target's device in its
        dtype, ``max_model_len`` the target's).

    Raises:
        ConfigArgumentError: A setting or model the draft model cannot serve (module docs).
        ModelLoadError: The draft cannot be loaded (an unsupported architecture, no weights).
    """
    from ..loader import load_model
    from ..model_runner import is_hybrid

    spec: Optional[SpeculativeConfig] = config.speculative
    assert spec is not None and spec.model is not None
    path = spec.model
    for name in _TIER_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            shown = "<set>" if name == "remote_cache_url" else value
            reason = (f"a draft model does not run with {name} = {shown!r}: the prefix-cache "
                      f"tiers below the host hold the target's KV only (the host tier, "
                      f"host_cache_memory, serves a draft model)")
            raise _bad(path, reason)
    tkinds = target.layer_kinds
    if any(k.kind != "full" for k in tkinds):
        raise _bad(path, f"the target {target.path or 'in memory'!r} has "
                   f"{_kinds_text(tkinds)} attention layers; a draft model needs a target whose "
                   f"layers all attend fully (windowed layers release blocks the draft reads)")
    if not os.path.exists(path):
        raise _bad(path, "no such file or directory (the draft model's path)")
    draft = load_model(path, device=target.device, dtype=target.dtype, load_tokenizer=False)
    tv = int(getattr(target.config, "vocab_size", 0) or 0)
    dv = int(getattr(draft.config, "vocab_size", 0) or 0)
    if tv != dv:
        raise _bad(path, f"the draft's vocabulary has {dv} tokens, the target's {tv}: a draft "
                   f"must share the target's vocabulary")
    dkinds = draft.layer_kinds
    if is_hybrid(dkinds):
        raise _bad(path, f"the draft's layers form several KV cache groups "
                   f"({_kinds_text(dkinds)} attention layers), which a draft model does not "
                   f"support yet")
    if draft.max_model_len < target.max_model_len:
        log.warning("the draft model's context (%d) is shorter than the target's (%d): "
                    "max_model_len is capped at %d", draft.max_model_len, target.max_model_len,
                    draft.max_model_len)
        target = dataclasses.replace(target, max_model_len=draft.max_model_len)
    # Same context, so both runners' block-table rows are as wide.
    draft = dataclasses.replace(draft, max_model_len=target.max_model_len)
    return target, draft


def draft_spec(draft: Any, block_size: int) -> CacheSpec:
    """The :class:`~pagedkv.config.CacheSpec` of ``draft``'s KV pool (what one block of it costs
    beside the target's)."""
    from ..model_runner import _head_dim

    cfg = draft.config
    num_q = int(cfg.num_attention_heads)
    return CacheSpec(num_layers=int(cfg.num_hidden_layers),
                     num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_q),
                     head_dim=_head_dim(cfg), dtype=str(draft.dtype).rpartition(".")[2],
                     block_size=block_size)


def build_draft_runner(draft: Any, target_runner: Any, config: Any) -> Any:
    """The draft's :class:`~pagedkv.engine.model_runner.ModelRunner`: the engine's step shape and
    kernels, a pool of the target runner's block count."""
    from ..model_runner import ModelRunner

    cfg = dataclasses.replace(config, num_blocks=int(target_runner.num_blocks),
                              kv_cache_memory=None, gpu_memory_utilization=None,
                              speculative_config=None, record_steps=False)
    return ModelRunner(draft, cfg)


def _np(x: Any) -> np.ndarray:
    """A numpy view of a host buffer (torch CPU tensor or numpy array)."""
    return x if isinstance(x, np.ndarray) else x.numpy()


class DraftModelProposer(Proposer):
    """Drafts with a draft model whose KV lives in the engine's block manager (module docs).

    Args:
        config: The speculative settings (``method == "draft_model"``).
        vocab_size: The target's vocabulary (the draft's was checked equal by :func:`load_draft`).
        draft: The draft's :class:`~pagedkv.engine.model_runner.ModelRunner`
            (:func:`build_draft_runner`).

    Raises:
        ConfigArgumentError: No draft runner given.
    """

    method = "draft_model"
    drafts_in_step = True

    def __init__(self, config: SpeculativeConfig, vocab_size: int, draft: Any = None) -> None:
        super().__init__(config, vocab_size)
        if draft is None:
            raise _bad(config.model, "the draft model's runner is built with the engine "
                       "(LLM / LLMEngine); none was given")
        #: The draft's runner (its pool, step buffers and forward).
        self.runner = draft
        #: Draft forwards run (tests and benches read it).
        self.num_forwards = 0

    def propose(self, token_ids: Sequence[Sequence[int]], limits: Sequence[int]) -> Drafts:
        """How many drafts each sequence gets (``min(k, limit)``), as placeholder ids: the
        tokens are drawn by :meth:`draft_step` once the scheduler has given them slots."""
        ks = clamp_limits(limits, self.config.num_speculative_tokens)
        return Drafts([[0] * k for k in ks])

    def draft_step(self, batch: Any, rows: Sequence[Optional[SamplerRow]]) -> Drafts:
        """Computes the draft's KV for the whole step and draws its drafts (module docs)."""
        r = self.runner
        step = batch.step
        host = batch.buffers.host
        n = int(step.num_seqs)
        n_out, n_in = int(step.num_swap_out), int(step.num_swap_in)
        if n_out or n_in:
            r._apply_swaps(host, n_out, n_in)
        if step.num_copies:
            r.pool.copy_blocks(host.copies[: step.num_copies])
        v = batch.buffers.views(step, on_device=False)
        qsl = _np(v.query_start_loc).astype(np.int64)
        slots = _np(v.slot_mapping)
        lens = _np(v.seq_lens).astype(np.int64)
        tables = _np(v.block_tables)
        drafts = batch.drafts
        k = np.array([len(drafts[i]) if drafts else 0 for i in range(n)], dtype=np.int64)
        ids = batch.input_ids()

        # The known tokens of every row (each row's first q_len - k tokens).
        known = np.diff(qsl) - k
        sel = np.concatenate([np.arange(qsl[i], qsl[i] + known[i]) for i in range(n)])
        drafted = [i for i in range(n) if k[i]]
        logits = self._forward(ids[sel], slots[sel], lens - k, tables, known, drafted)
        out: List[List[int]] = [[] for _ in range(n)]
        qs: List[List[Any]] = [[] for _ in range(n)]
        self._draw(logits, drafted, rows, out, qs)
        for j in range(1, int(k.max()) + 1 if n else 1):
            act = [i for i in drafted if k[i] >= j]
            a = np.asarray(act, dtype=np.int64)
            want = [x for x, i in enumerate(act) if k[i] > j]
            logits = self._forward(np.array([out[i][j - 1] for i in act], dtype=np.int64),
                                   slots[qsl[a] + j], lens[a] - k[a] + j, tables[a],
                                   np.ones(len(act), dtype=np.int64), want)
            self._draw(logits, [act[x] for x in want], rows, out, qs)
        probs: List[Any] = [None] * n
        for i in drafted:
            drafts[i][:] = out[i]
            if qs[i]:
                probs[i] = torch.stack(qs[i])
        return Drafts(out, probs if any(p is not None for p in probs) else [])

    def _forward(self, ids: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
                 tables: np.ndarray, q_lens: np.ndarray, sample_rows: Sequence[int]
                 ) -> torch.Tensor:
        """One draft forward: fills the draft runner's step buffers (rows in order, ``q_lens[i]``
        new tokens ending each row's ``seq_lens[i]``) and runs it; logits of ``sample_rows``."""
        r = self.runner
        h = r.buffers.host
        n, t = int(q_lens.shape[0]), int(ids.shape[0])
        _np(h.slot_mapping)[:t] = slots
        _np(h.seq_lens)[:n] = seq_lens
        q = _np(h.query_start_loc)
        q[0] = 0
        q[1:n + 1] = np.cumsum(q_lens)
        bt = _np(h.block_tables)
        w = min(bt.shape[1], tables.shape[1])
        bt[:n, :w] = tables[:, :w]
        info = StepInfo(n, t, 0, 0, int(seq_lens.max()), 0, 0, int(q_lens.max()))
        self.num_forwards += 1
        return r.execute(ids, None, info, list(sample_rows))

    def _draw(self, logits: torch.Tensor, seqs: Sequence[int],
              rows: Sequence[Optional[SamplerRow]], out: List[List[int]],
              qs: List[List[Any]]) -> None:
        """Draws the next draft of each of ``seqs`` (batch rows) from its logits row (in order),
        appending it to ``out[i]`` and, for a sampled row, its distribution to ``qs[i]``."""
        if not seqs:
            return
        pos_rows: List[SamplerRow] = []
        for i in seqs:
            s = rows[i]
            assert s is not None
            d = out[i]
            hist: Sequence[int] = (list(s.token_ids) + d) if s.params.has_penalties else ()
            pos_rows.append(SamplerRow(s.params, s.seed, s.num_generated + len(d), hist,
                                       s.num_prompt_tokens, s.min_tokens_banned))
        x = process_logits(logits, pos_rows)
        picks: List[int] = x.argmax(dim=-1).tolist()
        rand = [j for j, p in enumerate(pos_rows) if not p.params.greedy]
        if rand:
            dev = logits.device
            idx = torch.tensor(rand, dtype=torch.int64, device=dev)
            q = torch.softmax(filter_logits(x[idx], [pos_rows[j].params for j in rand]), dim=-1)
            for m, j in enumerate(rand):
                p = pos_rows[j]
                gen = torch.Generator(device=dev)
                gen.manual_seed(token_seed(p.seed ^ DRAFT_SEED_SALT, p.num_generated))
                picks[j] = int(torch.multinomial(q[m], 1, generator=gen))
                qs[seqs[j]].append(q[m])
        for j, i in enumerate(seqs):
            out[i].append(int(picks[j]))
