"""The cost model's rates for :class:`~pagedkv.engine.model_runner.ModelRunner`: measuring them
on the device and caching them in the cache directory.

Owns :class:`Rates` (host link bandwidth, prefill throughput, step floor) and ``_RatesMixin``, the
runner's :meth:`~_RatesMixin.measure_rates`, :meth:`~_RatesMixin.rates_key` and
:meth:`~_RatesMixin.measure_rates_now`, with the helpers that fingerprint a model on disk and
check a cached record.

Invariants: a cached record is used only when its key equals the runner's and its rates are finite
and positive (anything else is deleted and measured again); a model without a file on disk is
always measured and never recorded. Measuring runs real steps through a scratch
:class:`~pagedkv.BlockManager` on the runner's buffers, so it runs before the engine's manager
attaches them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ..manager import BlockManager

# The runner's logger: the rates' log lines keep the name they are filtered by.
_log = logging.getLogger("pagedkv.engine.model_runner")


def _model_fingerprint(path: str) -> str:
    """A digest of the model on disk: a GGUF file's (:func:`pagedkv.cache_dir.file_digest`), or a
    directory's ``config.json`` bytes and the names, sizes and mtimes of its weight files."""
    from ..cache_dir import file_digest

    if os.path.isfile(path):
        return file_digest(path)
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as fh:
        h.update(fh.read())
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".pt")):
            st = os.stat(os.path.join(path, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:32]


def _rates_ok(r: Any, need_link: bool) -> bool:
    """Whether a cached rates record holds usable rates."""
    def pos(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
            and x > 0

    link = r["host_link_bytes_per_s"]
    floor = r["step_floor_s"]
    return (pos(r["prefill_tokens_per_s"]) and (pos(floor) or floor == 0)
            and (pos(link) if need_link else link is None or pos(link)))


def _fmt_rates(r: "Rates") -> str:
    link = ("n/a" if math.isnan(r.host_link_bytes_per_s)
            else f"{r.host_link_bytes_per_s / 1e9:.2f} GB/s")
    return (f"host link {link}, prefill {r.prefill_tokens_per_s:.0f} tok/s, step floor "
            f"{r.step_floor_s * 1e3:.2f} ms")


class Rates(NamedTuple):
    """What :meth:`ModelRunner.measure_rates` measured: the cost model's rates."""

    #: Host <-> device copy bandwidth, bytes per second, one direction (NaN without a host pool).
    host_link_bytes_per_s: float
    #: Prefill throughput once a step is past its floor, tokens per second.
    prefill_tokens_per_s: float
    #: Seconds a step costs however few tokens it carries (``max(floor, tokens / rate)``).
    step_floor_s: float


class _RatesMixin:
    """:class:`~pagedkv.engine.model_runner.ModelRunner`'s cost-model rates (measured or cached)."""

    def measure_rates(self, *, tokens: Optional[int] = None, cache: bool = True) -> "Rates":
        """The cost model's rates on this device (:class:`Rates`): read from the cache directory
        (:mod:`pagedkv.cache_dir`, ``rates/<key>.json``) when this model file, device, dtype,
        pool, step shape, host pool and forward were measured before, else measured
        (:meth:`measure_rates_now`) and recorded there. ``cache=False`` always measures, and
        records nothing. A model without a path on disk (built in memory) is always measured.
        A record is used only if its key equals this runner's (:meth:`rates_key`) and its rates
        are finite and positive; anything else is deleted and measured again.
        """
        key = self.rates_key(tokens) if cache else None
        if key is None:
            return self.measure_rates_now(tokens=tokens)
        from .. import cache_dir

        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        record = cache_dir.read_json("rates", name, lambda d: d["key"] == key
                                     and _rates_ok(d["rates"], self.swap is not None))
        if record is not None:
            r = record["rates"]
            link = r["host_link_bytes_per_s"]
            rates = Rates(float("nan") if link is None else float(link),
                          float(r["prefill_tokens_per_s"]), float(r["step_floor_s"]))
            _log.info("cost-model rates from the cache (%s): %s", name, _fmt_rates(rates))
            return rates
        t0 = time.perf_counter()
        rates = self.measure_rates_now(tokens=tokens)
        _log.info("cost-model rates measured in %.1f s: %s", time.perf_counter() - t0,
                  _fmt_rates(rates))
        link = rates.host_link_bytes_per_s
        cache_dir.write_json("rates", name, {"key": key, "rates": {
            "host_link_bytes_per_s": None if math.isnan(link) else link,
            "prefill_tokens_per_s": rates.prefill_tokens_per_s,
            "step_floor_s": rates.step_floor_s}})
        return rates

    def rates_key(self, tokens: Optional[int] = None) -> Optional[dict]:
        """What the measured rates depend on, as a JSON-able dict; ``None`` when the model has no
        file to fingerprint (then rates are not cached)."""
        path = getattr(self.loaded, "path", "") or ""
        try:
            fingerprint = _model_fingerprint(path) if path else None
        except OSError:
            fingerprint = None
        if fingerprint is None:
            return None
        import platform

        if self.is_cuda:
            device = torch.cuda.get_device_name(self.device)
        else:
            device = (f"cpu {platform.machine()} {platform.processor()} "
                      f"{torch.get_num_threads()} threads")
        cfg = self.engine_config
        return {
            "version": 1, "model": fingerprint, "device": device, "torch": torch.__version__,
            "dtype": self.spec.dtype, "block_size": self.block_size, "num_blocks": self.num_blocks,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens":
            self.max_num_batched_tokens, "max_model_len": self.max_model_len, "tokens": tokens,
            "host_blocks": None if self.swap is None else int(self.swap.host.num_blocks),
            "staging_blocks": None if self.swap is None else int(self.swap.staging_blocks),
            "attention_backend": self.attention_backend, "fused": bool(self.fused),
            "cuda_graphs": bool(cfg.cuda_graphs and self.graph_sizes),
            "small_batch_gemv": self.gemv_rows, "tp_size": self.tp_size,
        }

    def measure_rates_now(self, *, tokens: Optional[int] = None) -> "Rates":
        """The cost model's rates measured on this device (:class:`Rates`).

        The link rate is a swap-out plus swap-in round trip of as many blocks as the staging holds
        (at most 32 MiB each way after one warm-up; NaN without a host pool).

        The step model ``max(floor, tokens / rate)`` is fitted where a recompute runs: beside a
        batch of up to 32 decoding sequences, as the scheduler re-admits a recomputed sequence.
        A decode-only step, then the same step carrying a prefill chunk of half and of all the
        room the token budget leaves (``tokens``, default ``min(max_num_batched_tokens,
        max_model_len - 1)``): the two chunks' added times give the rate, and the tokens a step
        absorbs for free give the floor. When even the full chunk adds nothing measurable, the
        rate is the chunk alone over its time. Each time is the best of two after a warm-up,
        through a scratch manager on this runner's buffers. Run it before the engine's manager
        attaches the buffers: it overwrites pool and host blocks (all free at start-up).
        """
        sync = torch.cuda.synchronize if self.is_cuda else (lambda *a: None)
        link = float("nan")
        if self.swap is not None:
            n = max(1, min(self.swap.staging_blocks, self.num_blocks, self.swap.host.num_blocks,
                           (32 << 20) // self.spec.bytes_per_block))
            pairs = np.stack([np.arange(n), np.arange(n)], axis=1)
            best = float("inf")
            for _ in range(3):  # the first is a warm-up
                sync()
                t0 = time.perf_counter()
                self.swap.swap_out(pairs)
                self.swap.swap_in(pairs)
                self.swap.synchronize()
                best = min(best, time.perf_counter() - t0)
            link = 2 * n * self.spec.bytes_per_block / best
        bs = self.block_size
        t = tokens or min(self.max_num_batched_tokens, self.max_model_len - 1)
        t = max(1, min(t, (self.num_blocks - 1) * bs))
        # The decode batch: as many 16-token sequences (up to 32) as the pool, the batch size
        # and the budget leave room for beside the full chunk.
        ctx, steps = 16, 10  # 9 measured steps append one token each
        # With KV cache groups a sequence holds a block per group for each position (at most).
        kv_groups = list(getattr(self, "kv_groups", ()))
        ng = max(1, len(kv_groups))
        room_blocks = self.num_blocks - 1 - ng * -(-t // bs)
        per_seq = ng * -(-(ctx + steps) // bs)
        b = max(0, min(32, self.max_num_seqs - 1, t - 1, room_blocks // per_seq))
        chunk = t - b
        extra = {"groups": kv_groups} if len(kv_groups) > 1 else {}
        mgr = BlockManager(self.num_blocks, bs, watermark_blocks=0,
                           max_blocks_per_seq=self.max_blocks_per_seq, enable_prefix_caching=False,
                           **extra)
        mgr.attach_buffers(self.buffers)
        vocab = int(self.config.vocab_size)
        dec = list(range(1, b + 1))

        def timed(ids: list, news: list, inp: np.ndarray) -> float:
            step = mgr.step(ids, news)
            sync()
            t0 = time.perf_counter()
            self.execute(inp, None, step, [len(ids) - 1])
            sync()
            return time.perf_counter() - t0

        def run(n: int) -> float:
            """Best time of a step of the decode batch plus an ``n``-token prefill (0: none)."""
            ids = (np.arange(n, dtype=np.int64) * 7919) % vocab
            best = float("inf")
            for i in range(3):  # the first is a warm-up
                if dec:
                    mgr.append_batch(dec, [7] * b)
                if n:
                    mgr.admit(0, ids.tolist())
                tok = np.concatenate([np.full(b, 7, dtype=np.int64), ids])
                took = timed(dec + [0] * (n > 0), [1] * b + [n] * (n > 0), tok)
                if n:
                    mgr.free(0)
                if i:
                    best = min(best, took)
            return best

        try:
            for sid in dec:
                prompt = ((np.arange(ctx, dtype=np.int64) + sid) * 31) % vocab
                mgr.admit(sid, prompt.tolist())
                timed([sid], [ctx], prompt)
            if b == 0:
                full = run(chunk)
                rate, floor = chunk / full, min(run(min(16, chunk)), full)
            else:
                base = run(0)
                half, full = max(1, chunk // 2), chunk
                m_half, m_full = run(half) - base, run(full) - base
                if m_full - m_half > 0.02 * base and m_full > 0:
                    rate = (full - half) / (m_full - m_half)
                    absorbed = max(0.0, full - m_full * rate)
                else:  # the whole chunk rides along for free: a floor above the full step
                    rate = (full + b) / max(base + max(m_full, 0.0), 1e-9)
                    absorbed = float(full)
                floor = (absorbed + b) / rate
        finally:
            mgr.detach_buffers()
        return Rates(link, rate, floor)
