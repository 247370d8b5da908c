"""CUDA-graph capture and replay for :class:`~pagedkv.engine.model_runner.ModelRunner`, with the
CUDA side of a step's inputs (pinned staging, attention metadata, the decode plan's update).

Owns :func:`graph_batch_sizes` (the padded decode batch sizes captured), ``_GraphMixin``
(:meth:`~_GraphMixin.capture_graphs`, and the internal ``_stage``, ``_cuda_meta``,
``_update_plan``, ``_graph_size``, ``_replay``, ``_group_tables``, ``_verify_rows``,
``_stage_rows``), :func:`token_rows` (a verify step's tokens as decode rows), :func:`with_groups`
(the per-group metadata of a step with KV cache groups) and ``_GraphChain`` (one step captured as
several graphs of consecutive layers).

With speculation the graphs also replay verify steps: ``k + 1`` tokens a sequence, each run as a
decode row of its own over its sequence's table up to its position (the runner's buffers then hold
``max_graph_rows`` rows, more than ``max_num_seqs``).

Invariants: the graphs read the runner's device staging buffers and the step buffers' device
mirrors in place (every KV cache group's slot mapping and block tables included), so those keep
their addresses; padding rows of a replayed batch write no slot
and read no key (slot -1, length 0); all graphs share one memory pool, captured largest first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from . import fused as _fused
from .forward_context import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to 64, then of 32
    up to ``max_num_seqs`` (which is always included).

    Finer steps than powers of two above 16 keep padding waste under ~25% at large batches, where
    a decode step costs the most.
    """
    sizes = []
    for s in (1, 2, 4, 8):
        if s < max_num_seqs:
            sizes.append(s)
    s = 16
    while s < max_num_seqs:
        sizes.append(s)
        s += 16 if s < 64 else 32
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class _GraphMixin:
    """:class:`~pagedkv.engine.model_runner.ModelRunner`'s CUDA graphs and CUDA step inputs."""

    def _stage(self, ids: np.ndarray, pos: np.ndarray, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._ids_host[:t].numpy()[:] = ids
        self._pos_host[:t].numpy()[:] = pos
        self._ids_dev[:t].copy_(self._ids_host[:t], non_blocking=True)
        self._pos_dev[:t].copy_(self._pos_host[:t], non_blocking=True)
        self._inputs_copied.record()
        return self._ids_dev[:t], self._pos_dev[:t]

    def _cuda_meta(self, mode, slot_mapping, block_tables, seq_lens, qsl, *, max_q_len=0,
                   max_seq_len=0, groups: Optional[Sequence[Any]] = None,
                   positions: Optional[torch.Tensor] = None) -> AttentionMetadata:
        """The step's CUDA metadata; ``groups``: groups ``1..G-1``' ``(slot_mapping,
        block_tables)`` (device views), None with one group; ``positions``: the step's (device),
        read by a model with a positional query temperature only."""
        meta = AttentionMetadata(mode, self.pool.k_caches, self.pool.v_caches, slot_mapping,
                                 block_tables, seq_lens, qsl, max_q_len=max_q_len,
                                 max_seq_len=max_seq_len, workspace=self.workspace,
                                 gemv_rows=self.gemv_rows,
                                 plan=self.decode_plan if mode == "decode" else None,
                                 temperature=self.temperature,
                                 positions=positions if self.temperature is not None else None)
        if groups is not None:
            with_groups(meta, groups, self.grouping.layer_group)
        return meta

    def _group_tables(self, step: Any, on_device: bool = True) -> Optional[list]:
        """Groups ``1..G-1``' slot mappings and block tables cut to ``step`` (None with one
        group)."""
        if self.buffers.num_groups == 1:
            return None
        return [self.buffers.group_views(step, g, on_device=on_device)
                for g in range(1, self.buffers.num_groups)]

    def _update_plan(self, row_lens: np.ndarray, bs: int) -> None:
        """Plans a decode step of ``n = len(row_lens)`` rows run as a batch of ``bs >= n`` rows
        (a graph's padding rows have length 0). The plan only balances the work: the kernels read
        the lengths from the device mirrors, so a plan from stale host lengths (a TP rank whose
        host tables are not refreshed) costs speed, never correctness."""
        n = len(row_lens)
        lens = self._plan_lens
        lens[:n] = row_lens
        lens[n:bs] = 0
        self.decode_plan.update(lens[:bs])

    def _verify_rows(self, step: Any, qsl: np.ndarray) -> Optional[np.ndarray]:
        """A step of a few tokens a sequence (a speculative verify step) as decode rows: each
        token's sequence and the length it attends to (:func:`token_rows`), or None where no
        captured graph takes it (no speculation, a longer query, more rows than captured, tensor
        parallelism: the other ranks' host tables are not refreshed)."""
        n, t = int(step.num_seqs), int(step.num_tokens)
        if (self.graph_query_len <= 1 or not self._graphs or self.broadcaster is not None
                or t == n or t > self.graph_sizes[-1]
                or int(np.diff(qsl).max()) > self.graph_query_len):
            return None
        return token_rows(qsl, self.buffers.host.seq_lens[:n].numpy())

    def _stage_rows(self, rows: np.ndarray, n: int) -> None:
        """Makes the device mirrors hold a verify step's decode rows, in place: row ``i`` of
        every group's block tables becomes its token's sequence's row, ``seq_lens[i]`` the
        token's own length (its position + 1). The slot mappings are per token already. Runs
        before :meth:`_stage`, whose event then also covers this copy."""
        t = rows.shape[1]
        r = self.max_graph_rows
        self._rows_host[:t].numpy()[:] = rows[0]
        self._rows_host[r:r + t].numpy()[:] = rows[1]
        self._rows_dev[:t].copy_(self._rows_host[:t], non_blocking=True)
        self._rows_dev[r:r + t].copy_(self._rows_host[r:r + t], non_blocking=True)
        idx = self._rows_dev[:t]
        dev = self.buffers.device
        dev.block_tables[:t].copy_(dev.block_tables[:n].index_select(0, idx))
        for g in self.buffers.groups_device:
            g.block_tables[:t].copy_(g.block_tables[:n].index_select(0, idx))
        dev.seq_lens[:t].copy_(self._rows_dev[r:r + t])

    def _graph_size(self, n: int) -> Optional[int]:
        for s in self.graph_sizes:
            if s >= n:
                return s
        return None

    def capture_graphs(self, sizes: Optional[Sequence[int]] = None, *, pieces: int = 1) -> None:
        """Captures one decode CUDA graph per padded batch size (default :func:`graph_batch_sizes`).

        ``pieces > 1`` (fused forward only): each batch size's step is captured as that many
        graphs of consecutive layers, replayed in turn, so the GPU starts on the first while the
        host still launches the later ones (the same kernels on the same buffers: equal logits).

        Each graph runs the whole model on ``bs`` tokens: static ids/positions (the runner's device
        staging buffers), and the step buffers' device mirrors ``slot_mapping[:bs]``,
        ``block_tables[:bs]``, ``seq_lens[:bs]`` in place. With the decode planner, each graph
        launches the plan's fixed grid and reads the plan updated before each replay; without it,
        the split count is fixed at capture from ``max_model_len`` (each sequence's own split
        length is computed in the kernel). Graphs share one memory pool, captured largest first.
        """
        if not (self.is_cuda and self.use_kernels):
            return
        sizes = sorted(set(sizes or graph_batch_sizes(self.max_graph_rows)), reverse=True)
        dev = self.buffers.device
        mempool = torch.cuda.graph_pool_handle()
        for bs in sizes:
            if bs > self.max_graph_rows:
                continue
            # Padding: no slot written, no key read. Warm-up and capture see the same state.
            dev.slot_mapping[:bs].fill_(-1)
            dev.seq_lens[:bs].fill_(0)
            if self.decode_plan is not None:
                # A graph captured with a plan launches its fixed grid and reads the plan's
                # buffers in place: each replay runs the plan updated just before it.
                self._plan_lens[:bs] = 0
                self.decode_plan.update(self._plan_lens[:bs])
            groups = None
            if self.buffers.num_groups > 1:
                # Every group's tables at their fixed addresses, padding inert as group 0's.
                groups = [(g.slot_mapping[:bs], g.block_tables[:bs])
                          for g in self.buffers.groups_device]
                for sm, _ in groups:
                    sm.fill_(-1)
            meta = self._cuda_meta("decode", dev.slot_mapping[:bs], dev.block_tables[:bs],
                                   dev.seq_lens[:bs], dev.query_start_loc[: bs + 1],
                                   max_seq_len=self.max_model_len, groups=groups,
                                   positions=self._pos_dev[:bs])
            ids = self._ids_dev[:bs][None]
            pos = self._pos_dev[:bs][None]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels, settles lazy allocations
                    self._forward(meta, ids, pos, 0)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if pieces > 1 and self.fused:
                chain = _GraphChain(self.model, meta, ids, pos, pieces, mempool)
                self._graphs[bs] = (chain, chain.logits)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                logits = self._forward(meta, ids, pos, 0)
            self._graphs[bs] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.graph_sizes = sorted(self._graphs)

    def _replay(self, bs: int, n: int, ids_d, pos_d, last: np.ndarray) -> torch.Tensor:
        graph, logits = self._graphs[bs]
        if n < bs:
            dev = self.buffers.device
            # The mirrors past the step hold stale rows: make the padding rows inert.
            dev.slot_mapping[n:bs].fill_(-1)
            dev.seq_lens[n:bs].fill_(0)
            for g in self.buffers.groups_device:
                g.slot_mapping[n:bs].fill_(-1)
        graph.replay()
        # Decode: batch row k's token is packed row k.
        if last.size == n and np.array_equal(last, np.arange(n)):
            return logits[0, :n].float()
        idx = torch.from_numpy(last).to(self.device, non_blocking=True)
        return logits[0].index_select(0, idx).float()


def token_rows(qsl: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """A step's tokens as decode rows: int32 ``[2, num_tokens]``, row 0 each token's sequence
    (batch row), row 1 the keys it attends to (its position + 1, its own included).

    Sequence ``s``'s ``j``-th new token of ``q = qsl[s + 1] - qsl[s]`` sits at position
    ``seq_lens[s] - q + j``, so a decode row for it, reading the sequence's block table up to that
    length, computes exactly the causal attention of the step (the step's keys are all written
    before any row reads: ``scatter_kv`` precedes the decode kernel in every layer)."""
    q = np.diff(qsl)
    seq = np.repeat(np.arange(q.shape[0], dtype=np.int64), q)
    t = seq.shape[0]
    # Each token's length: its sequence's length less the tokens after it in the step.
    lens = np.asarray(seq_lens, dtype=np.int64)[seq] - (qsl[1:][seq] - 1 - np.arange(t))
    return np.stack([seq, lens]).astype(np.int32)


def with_groups(meta: AttentionMetadata, groups: Sequence[Any],
                layer_group: Sequence[int]) -> AttentionMetadata:
    """Gives ``meta`` (group 0's) one metadata object per KV cache group: groups ``1..G-1``
    (``groups``: their ``(slot_mapping, block_tables)``) as copies of ``meta`` with their own
    tables; each layer then reads its group's (``layer_group``). Returns ``meta``."""
    metas = [meta]
    for sm, bt in groups:
        metas.append(dataclasses.replace(meta, slot_mapping=sm, block_tables=bt))
    meta.groups = metas
    meta.layer_group = tuple(layer_group)
    return meta


class _GraphChain:
    """One decode step captured as several CUDA graphs of consecutive layers (the first with the
    embedding, the last with the final norm and LM head) in one memory pool; :meth:`replay` runs
    them in order on the current stream. The hidden state and residual handed from one graph to
    the next are tensors of the pool this object keeps alive, so no later capture reuses them."""

    def __init__(self, model: Any, meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor,
                 pieces: int, mempool: Any) -> None:
        n_layers = int(model.config.num_hidden_layers)
        pieces = max(1, min(pieces, n_layers))
        cuts = [round(n_layers * k / pieces) for k in range(pieces + 1)]
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._keep: list[torch.Tensor] = []
        h = cos = sin = logits = torch.empty(0)
        residual: Optional[torch.Tensor] = None
        with torch.inference_mode():
            for k in range(pieces):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=mempool):
                    if k == 0:
                        h, cos, sin = _fused.fused_prologue(model, ids, pos)
                    h, residual = _fused.fused_layers(model, meta, h, residual, cos, sin,
                                                      cuts[k], cuts[k + 1])
                    if k == pieces - 1:
                        logits = _fused.fused_epilogue(model, meta, h, residual, 0)
                self.graphs.append(g)
                self._keep += [h, residual, cos, sin]
        self.logits = logits

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()
