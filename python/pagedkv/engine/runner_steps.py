"""The step path of :class:`~pagedkv.engine.model_runner.ModelRunner`: validating a step,
applying its swaps and copies to the pool, and running the forward.

Owns ``_StepMixin`` (:meth:`~_StepMixin.execute`, :meth:`~_StepMixin.serve`,
:meth:`~_StepMixin.step_record` and the internal ``_run``, ``_apply_swaps``, ``_run_cpu``,
``_forward``) and ``_as_int64``, the argument check for ids and positions.

Invariants: bad input raises :mod:`pagedkv.errors` before the pool is touched; a step's swaps
(swap-outs, then swap-ins) and copy-on-write copies reach the pool before any layer reads or
writes it; with tensor parallelism only rank 0 executes (and broadcasts the validated step), the
other ranks run what it sends from ``serve``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from ..distributed.step_broadcast import CMD_STEP, CMD_STOP
from ..errors import InvalidArgumentError, InvalidConfigError
from . import attention as _attention
from . import fused as _fused
from .forward_context import AttentionMetadata, forward_context
from .runner_graphs import with_groups


class _StepMixin:
    """:class:`~pagedkv.engine.model_runner.ModelRunner`'s steps: validation, swaps, forward."""

    def execute(self, input_ids: Any, positions: Optional[Any], step: Any,
                sample_rows: Sequence[int], *,
                extra_logit_indices: Optional[Sequence[int]] = None,
                ids_from: Optional[Tuple[np.ndarray, torch.Tensor]] = None) -> torch.Tensor:
        """Runs one step; returns float32 logits ``[len(sample_rows) + len(extra), vocab]``.

        Args:
            input_ids: The step's new tokens, concatenated in batch order (``step.num_tokens``
                ints: numpy array, list or CPU tensor).
            positions: ``None``: the step's own (:meth:`pagedkv.StepBuffers.positions`, read
                from what the manager wrote: the one source). Given, they must equal those.
            step: The :class:`pagedkv.StepInfo` that ``manager.step`` returned for this batch
                (the manager filled :attr:`buffers`).
            sample_rows: Batch rows ``k`` whose last new token (index
                ``query_start_loc[k + 1] - 1``) gets logits, in the order wanted.
            extra_logit_indices: Packed token indices (``0 .. num_tokens - 1``) whose logits are
                appended after the sampled rows' (prompt logprobs). Not with tensor parallelism.
            ids_from: ``(indices, tokens)``: the packed input ids at ``indices`` are read from
                ``tokens`` (a tensor on the runner's device, one per index) instead of
                ``input_ids``, whose entries there are placeholders: the tokens a previous step
                sampled, not yet read by the host (asynchronous scheduling). Not with tensor
                parallelism.

        With tensor parallelism (rank 0 only), the validated step — its tables and batch — is
        broadcast first, and every other rank runs it from :meth:`serve`.

        Raises:
            InvalidArgumentError: Lengths disagree with ``step``, given positions are not the
                step's, a sequence is longer than the model's context, a row is out of range, or
                the step exceeds the buffers.
            InvalidConfigError: Called on a tensor-parallel rank other than 0.
        """
        if self.tp_rank != 0:
            raise InvalidConfigError(
                f"tensor-parallel rank {self.tp_rank} runs the steps rank 0 sends (serve()), "
                f"not its own", field="tensor_parallel_size", value=self.tp_size,
                reason="execute on rank 0 only")
        n, t = int(step.num_seqs), int(step.num_tokens)
        ids = _as_int64(input_ids, "input_ids")
        given = None if positions is None else _as_int64(positions, "positions")
        if ids.shape[0] != t:
            raise InvalidArgumentError(
                f"invalid argument: input_ids has {ids.shape[0]} tokens, the step has {t}",
                what="input_ids", value=int(ids.shape[0]),
                reason=f"must have step.num_tokens = {t} entries")
        if t == 0 or n == 0:
            raise InvalidArgumentError("invalid argument: step: an empty step", what="step",
                                       value=0, reason="needs at least one token")
        if t > self.max_num_batched_tokens or n > self.max_num_seqs:
            raise InvalidArgumentError(
                f"invalid argument: step: {n} sequences / {t} tokens exceed the runner's "
                f"{self.max_num_seqs} / {self.max_num_batched_tokens}", what="step", value=t,
                reason="exceeds max_num_seqs / max_num_batched_tokens")
        rows = np.asarray(sample_rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise InvalidArgumentError(
                f"invalid argument: sample_rows: row {int(rows.max() if rows.max() >= n else rows.min())}"
                f" outside the batch of {n}", what="sample_rows", value=int(rows.size),
                reason=f"rows must be in [0, {n})")
        vocab = int(self.config.vocab_size)
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise InvalidArgumentError(
                f"invalid argument: input_ids: token ids must be in [0, {vocab})",
                what="input_ids", value=int(ids.max()), reason="outside the vocabulary")
        if int(step.max_seq_len) > self.max_model_len:
            raise InvalidArgumentError(
                f"invalid argument: step: a sequence of {int(step.max_seq_len)} tokens exceeds the "
                f"model's context of {self.max_model_len}", what="step",
                value=int(step.max_seq_len), reason=f"must be <= {self.max_model_len}")
        pos = self.buffers.positions(step)
        if given is not None and not np.array_equal(given, pos):
            bad = int(np.flatnonzero(given != pos)[0]) if given.shape == pos.shape else -1
            raise InvalidArgumentError(
                f"invalid argument: positions: {given.shape[0]} positions differ from the step's "
                f"(first at index {bad}): the step's are read from its tables",
                what="positions", value=bad, reason="must equal buffers.positions(step)")
        extra = np.asarray(extra_logit_indices if extra_logit_indices is not None else (),
                           dtype=np.int64).reshape(-1)
        if extra.size and (self.broadcaster is not None or extra.min() < 0 or extra.max() >= t):
            raise InvalidArgumentError(
                f"invalid argument: extra_logit_indices: must be in [0, {t}), without tensor "
                f"parallelism", what="extra_logit_indices", value=int(extra.size),
                reason=f"indices must be in [0, {t})")
        if ids_from is not None:
            at, tokens = ids_from
            at = np.asarray(at, dtype=np.int64).reshape(-1)
            if (self.broadcaster is not None or tokens.shape != at.shape
                    or (at.size and (at.min() < 0 or at.max() >= t))):
                raise InvalidArgumentError(
                    f"invalid argument: ids_from: {at.size} indices in [0, {t}) with one token "
                    f"each, without tensor parallelism", what="ids_from", value=int(at.size),
                    reason=f"indices must be in [0, {t}), one token each")
            ids_from = (at, tokens)
        if self.broadcaster is not None:
            # Every rank runs this step: send it (validated, so no rank sees a bad one).
            self.broadcaster.send_step(step, ids, pos, rows)
        return self._run(ids, pos, step, rows,
                         inputs_on_device=self.is_cuda and self.tp is not None, extra=extra,
                         ids_from=ids_from)

    def serve(self, *, until: Sequence[int] = ()) -> int:
        """A rank other than 0: runs the steps rank 0 broadcasts until a command; returns it.

        Returns on STOP, and on any command in ``until`` (``CMD_END``: the driver's ``generate``
        finished). Each step is run exactly as rank 0 runs it (same tables, same batch), its logits
        dropped: rank 0 samples.
        """
        if self.broadcaster is None or self.tp_rank == 0:
            raise InvalidConfigError("serve() runs on a tensor-parallel rank other than 0",
                                     field="tensor_parallel_size", value=self.tp_size,
                                     reason="not a receiving rank")
        while True:
            got = self.broadcaster.recv()
            if got.cmd == CMD_STEP:
                self._run(got.input_ids, got.positions, got.info, got.sample_rows,
                          inputs_on_device=self.is_cuda)
            elif got.cmd == CMD_STOP or got.cmd in until:
                return got.cmd

    def _run(self, ids: Optional[np.ndarray], pos: Optional[np.ndarray], step: Any,
             rows: np.ndarray, *, inputs_on_device: bool,
             extra: Optional[np.ndarray] = None,
             ids_from: Optional[Tuple[np.ndarray, torch.Tensor]] = None) -> torch.Tensor:
        """The step itself (arguments validated). ``inputs_on_device``: the step buffers' device
        mirrors and the device ids/positions already hold this step (filled from the TP packet),
        so nothing is copied from the host; ``ids``/``pos`` may then be None."""
        n, t = int(step.num_seqs), int(step.num_tokens)
        host = self.buffers.host
        qsl = host.query_start_loc[: n + 1].numpy()
        last = qsl[1:][rows] - 1 if rows.size else np.zeros(0, dtype=np.int64)
        if extra is not None and extra.size:
            last = np.concatenate([last, extra])

        n_out = getattr(step, "num_swap_out", 0)
        n_in = getattr(step, "num_swap_in", 0)
        # A decode step with extra logits rows runs eagerly; a verify step (a few tokens a
        # sequence, speculation) may replay a graph with one decode row per token, whose logits
        # are there for every row.
        decode = t == n and not (extra is not None and extra.size)
        graph_bs = self._graph_size(n) if decode else None
        vrows = None if decode or not self.is_cuda else self._verify_rows(step, qsl)
        if vrows is not None:
            graph_bs = self._graph_size(t)
        if n_out or n_in:
            self._apply_swaps(host, n_out, n_in)
        if step.num_copies:
            # Copy-on-write before any layer writes: the copies carry the shared prefix of a block
            # into its private copy, and this step's new tokens land in the copy.
            self.pool.copy_blocks(host.copies[: step.num_copies])
        if inputs_on_device:
            dev = self.buffers.views(step, on_device=True)
        else:
            dev = self.buffers.to_device(step)
        if self.step_records is not None:
            self.step_records.append(self.step_record(step, ids, pos, rows))

        if not self.use_kernels:
            if ids is None:  # the step's batch arrived on the device (TP over NCCL)
                ids, pos = self._ids_dev[:t].cpu().numpy(), self._pos_dev[:t].cpu().numpy()
            if ids_from is not None and ids_from[0].size:
                ids = ids.copy()
                ids[ids_from[0]] = ids_from[1].cpu().numpy()
            return self._run_cpu(ids, pos, dev, n, qsl, last, self._group_tables(step))
        if vrows is not None:
            self._stage_rows(vrows, n)
        if inputs_on_device:
            ids_d, pos_d = self._ids_dev[:t], self._pos_dev[:t]
        elif self.is_cuda:
            ids_d, pos_d = self._stage(ids, pos, t)
        else:
            ids_d, pos_d = torch.from_numpy(ids), torch.from_numpy(pos)
        if ids_from is not None and ids_from[0].size:
            # The previous step's sampled tokens, still on the device, into this step's inputs.
            at = torch.from_numpy(ids_from[0]).to(ids_d.device, non_blocking=True)
            ids_d.index_copy_(0, at, ids_from[1].to(ids_d.dtype))
        if self.decode_plan is not None and (decode or vrows is not None):
            self._update_plan(host.seq_lens[:n].numpy() if vrows is None else vrows[1],
                              graph_bs or n)
        if graph_bs is not None:
            if vrows is not None:
                self.graph_verify_steps += 1
            out = self._replay(graph_bs, n if vrows is None else t, ids_d, pos_d, last)
            self._inputs_copied.synchronize()
            return out
        groups = self._group_tables(step)
        if decode:
            meta = self._cuda_meta("decode", dev.slot_mapping, dev.block_tables, dev.seq_lens,
                                   dev.query_start_loc, max_seq_len=int(step.max_seq_len),
                                   groups=groups, positions=pos_d)
        else:
            meta = self._cuda_meta("prefill", dev.slot_mapping, dev.block_tables, dev.seq_lens,
                                   dev.query_start_loc, max_seq_len=int(step.max_seq_len),
                                   max_q_len=int(step.max_query_len) or int(np.diff(qsl).max()),
                                   groups=groups, positions=pos_d)
        last_d = torch.from_numpy(last).to(self.device, non_blocking=True)
        out = self._forward(meta, ids_d[None], pos_d[None], last_d)[0].float()
        if self.is_cuda:
            self._inputs_copied.synchronize()
        return out

    def step_record(self, step: Any, ids: Optional[np.ndarray], pos: Optional[np.ndarray],
                    rows: np.ndarray) -> dict:
        """What this rank is about to run: the step's extent, the bytes of every step table in
        its extent as the model will read them (the device mirrors), the batch, and the addresses
        of the step buffers' device tensors. For checking ranks against each other (tests)."""
        dev = self.buffers.views(step, on_device=True)
        rec: dict = {"info": tuple(int(x) for x in step)}
        for name, tns in dev.items():
            rec[name] = tns.cpu().numpy().tobytes()
        t = int(step.num_tokens)
        if ids is None:
            ids, pos = self._ids_dev[:t].cpu().numpy(), self._pos_dev[:t].cpu().numpy()
        rec["input_ids"] = np.asarray(ids, dtype=np.int64).tobytes()
        rec["positions"] = np.asarray(pos, dtype=np.int64).tobytes()
        rec["sample_rows"] = np.asarray(rows, dtype=np.int64).tobytes()
        rec["addresses"] = tuple(tns.data_ptr() for _, tns in self.buffers.device.items())
        return rec

    def _apply_swaps(self, host: Any, n_out: int, n_in: int) -> None:
        """Queues the step's swaps and makes the forward's stream wait for them."""
        if self.swap is None:
            raise InvalidConfigError(
                "the step carries swaps but the runner has no host pool (call enable_swap with the "
                "manager's num_host_blocks)", field="num_host_blocks", value=0,
                reason="no host pool")
        # Swap-outs first: a device block a swap-out frees may be a swap-in's destination.
        if n_out:
            self.swap.swap_out(host.swap_out[:n_out])
        if n_in:
            self.swap.swap_in(host.swap_in[:n_in])
        # Only this step's forward waits (on the GPU) for the device side of its swaps.
        self.swap.wait()

    def _run_cpu(self, ids, pos, dev, n, qsl, last, groups=None) -> torch.Tensor:
        q_lens = torch.from_numpy(np.diff(qsl).astype(np.int64))
        seq_lens = dev.seq_lens.to(torch.int64)
        meta = AttentionMetadata("cpu", self.pool.k_caches, self.pool.v_caches, dev.slot_mapping,
                                 dev.block_tables, dev.seq_lens, dev.query_start_loc,
                                 temperature=self.temperature,
                                 positions=torch.from_numpy(pos) if self.temperature else None)
        if groups is not None:  # KV cache groups: each group's gathers and mask from its tables
            for m in with_groups(meta, groups, self.grouping.layer_group).groups or ():
                _attention.build_cpu_metadata(m, self.block_size, q_lens, seq_lens)
        else:
            _attention.build_cpu_metadata(meta, self.block_size, q_lens, seq_lens)
        ids_t = torch.from_numpy(ids)[None]
        pos_t = torch.from_numpy(pos)[None]
        return self._forward(meta, ids_t, pos_t, torch.from_numpy(last))[0].float()

    @torch.inference_mode()
    def _forward(self, meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor,
                 keep: Any) -> torch.Tensor:
        if self.fused:
            return _fused.fused_forward(self.model, meta, ids, pos, keep)
        with forward_context(meta, self.model):
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             logits_to_keep=keep)
        return out.logits


def _as_int64(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.numpy()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"invalid argument: {name}: {exc}", what=name, value=-1,
                                   reason="not an integer array") from None
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise InvalidArgumentError(f"invalid argument: {name}: expected a 1-D integer array",
                                   what=name, value=int(a.size), reason="not a 1-D integer array")
    return np.ascontiguousarray(a, dtype=np.int64)
