"""Seeded synthetic serving workloads for the simulator.

Owns :class:`WorkloadConfig` (the knobs), :class:`Request` (one generated request) and
:func:`generate`, which turns a config into a list of requests. Time is measured in scheduler
steps: one step is one forward pass of the running batch, producing one token per running sequence.

The shape of the default workload:

- **Arrivals** form a Poisson process with ``arrival_rate`` requests per step (exponential
  inter-arrival gaps), the usual model for independent users. The default, 0.08 per step, is a
  little below what paged allocation serves in ``pagedkv simulate``'s default pool (about 0.078
  measured) and far above what contiguous reservation serves there (about 0.015).
- **Prompt and output lengths** are log-normal, i.e. ``exp(N(ln median, sigma²))``, rounded and
  clipped to at least one token. Published production chat traces (for example the Azure LLM
  inference traces) show right-skewed token counts with a long tail, and a log-normal is the simple
  two-parameter shape with that profile. The defaults — prompts with median 600 and sigma 1.0
  (5th–95th percentile about 120–3100 tokens), outputs with median 250 and sigma 0.8 (about 70–930)
  — are round numbers of the order such traces report for conversation; they are not a fit to any
  one trace.
- **Capping**: a prompt is cut to ``max_model_len − 1`` tokens and each output to what is left, so
  every sequence fits in ``max_model_len`` (the contiguous baseline's reservation).
- **Shared system prompts** (off by default): with ``num_prefixes = K > 0``, a fraction
  ``prefix_fraction`` of requests start with one of K fixed ``prefix_len``-token prefixes, picked
  uniformly; the request's own prompt follows it.
- **Parallel sampling** (off by default): ``n_samples = n`` gives each request n outputs with
  independently drawn lengths and tokens, decoded as forks of the prompt.

Token ids are uniform in ``[0, vocab_size)``; their values only matter to the prefix cache, where
random ids make accidental sharing between unrelated prompts vanishingly unlikely.

Invariants: :func:`generate` is a pure function of the config (same seed → identical requests);
requests come out sorted by arrival step with ids ``0..num_requests-1``; for every request
``len(prompt) + max(output_lens) <= max_model_len``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import InvalidConfigError

__all__ = ["WorkloadConfig", "Request", "generate"]


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the synthetic workload; see the module docstring for their meaning and defaults."""

    num_requests: int = 4000
    arrival_rate: float = 0.08
    prompt_median: float = 600.0
    prompt_sigma: float = 1.0
    output_median: float = 250.0
    output_sigma: float = 0.8
    max_model_len: int = 8192
    num_prefixes: int = 0
    prefix_len: int = 0
    prefix_fraction: float = 0.5
    n_samples: int = 1
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, value: object, reason: str) -> InvalidConfigError:
            return InvalidConfigError(f"invalid workload: {field} = {value!r}: {reason}",
                                      field=field, value=value, reason=reason)

        for name, minimum in (("num_requests", 1), ("max_model_len", 2), ("num_prefixes", 0),
                              ("prefix_len", 0), ("n_samples", 1), ("vocab_size", 2), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, value, "must be an integer")
            if value < minimum:
                raise bad(name, value, f"must be >= {minimum}")
        if self.vocab_size > 2**32:
            raise bad("vocab_size", self.vocab_size, "token ids must fit in u32")
        for name, positive in (("arrival_rate", True), ("prompt_median", True), ("output_median", True),
                               ("prompt_sigma", False), ("output_sigma", False),
                               ("prefix_fraction", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "must be a finite number")
            if positive and value <= 0:
                raise bad(name, value, "must be > 0")
            if not positive and value < 0:
                raise bad(name, value, "must be >= 0")
        if self.prefix_fraction > 1:
            raise bad("prefix_fraction", self.prefix_fraction, "must be in [0, 1]")
        if self.num_prefixes > 0:
            if self.prefix_len < 1:
                raise bad("prefix_len", self.prefix_len, "must be >= 1 when num_prefixes > 0")
            if self.prefix_len > self.max_model_len - 2:
                raise bad("prefix_len", self.prefix_len,
                          f"must leave room for a prompt token and an output token within "
                          f"max_model_len {self.max_model_len}")
        elif self.prefix_len > 0:
            raise bad("num_prefixes", self.num_prefixes, "must be >= 1 when prefix_len > 0")

    @property
    def sharing(self) -> bool:
        """Whether any blocks can be shared between live sequences (prefixes or forks)."""
        return (self.num_prefixes > 0 and self.prefix_fraction > 0) or self.n_samples > 1


@dataclass(frozen=True, eq=False)
class Request:
    """One generated request.

    ``prompt`` holds the full prompt (shared prefix included) as int64 token ids; ``outputs[i]`` the
    tokens sample ``i`` will generate, whose length is that sample's output length.
    """

    req_id: int
    arrival_step: int
    prompt: np.ndarray
    outputs: tuple[list[int], ...]
    prefix_id: Optional[int]

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def output_lens(self) -> tuple[int, ...]:
        return tuple(len(o) for o in self.outputs)


def _lognormal_lengths(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    x = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    # Clip before the int cast: a huge sigma can draw values beyond int64.
    return np.maximum(np.rint(np.minimum(x, 2.0**40)), 1).astype(np.int64)


def generate(cfg: WorkloadConfig) -> list[Request]:
    """The requests of ``cfg``, sorted by arrival step; a pure function of ``cfg``."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    gaps = rng.exponential(1.0 / cfg.arrival_rate, size=n)
    arrivals = np.floor(np.cumsum(gaps)).astype(np.int64)
    prompt_lens = _lognormal_lengths(rng, cfg.prompt_median, cfg.prompt_sigma, n)
    output_lens = _lognormal_lengths(rng, cfg.output_median, cfg.output_sigma, n * cfg.n_samples)
    output_lens = output_lens.reshape(n, cfg.n_samples)
    prefixes = [rng.integers(0, cfg.vocab_size, size=cfg.prefix_len, dtype=np.int64)
                for _ in range(cfg.num_prefixes)]
    if cfg.num_prefixes > 0:
        uses_prefix = rng.random(n) < cfg.prefix_fraction
        prefix_ids = rng.integers(0, cfg.num_prefixes, size=n)
    else:
        uses_prefix = np.zeros(n, dtype=bool)
        prefix_ids = np.zeros(n, dtype=np.int64)
    requests = []
    mml = cfg.max_model_len
    for i in range(n):
        prefix_id = int(prefix_ids[i]) if uses_prefix[i] else None
        head = prefixes[prefix_id] if prefix_id is not None else np.empty(0, dtype=np.int64)
        total = min(int(head.shape[0]) + int(prompt_lens[i]), mml - 1)
        own = rng.integers(0, cfg.vocab_size, size=total - head.shape[0], dtype=np.int64)
        prompt = np.concatenate([head, own]) if head.shape[0] else own
        outputs = tuple(
            rng.integers(0, cfg.vocab_size, size=min(int(out_len), mml - total), dtype=np.int64).tolist()
            for out_len in output_lens[i]
        )
        requests.append(Request(req_id=i, arrival_step=int(arrivals[i]), prompt=prompt,
                                outputs=outputs, prefix_id=prefix_id))
    return requests
