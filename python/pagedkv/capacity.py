"""The capacity planner behind ``pagedkv plan``.

Owns the arithmetic that answers "how many sequences fit?" for a model on a device, for paged
allocation against contiguous max-length reservation:

- the pool: ``num_blocks = floor((memory × utilization − weights − activation peak − graph
  reserve) / bytes_per_block)`` (:func:`pagedkv.config.num_blocks_for`), token capacity
  ``num_blocks × block_size``;
- paged: a sequence of ``L`` tokens holds ``ceil(L / B)`` blocks, so ``floor(num_blocks /
  ceil(L / B))`` of them fit, each wasting at most ``B − 1`` slots;
- contiguous: every sequence reserves ``max_model_len`` slots whatever its length, so
  ``floor(capacity / max_model_len)`` fit, each wasting ``max_model_len − L`` slots.

Both concurrency figures ignore the watermark reserve and prefix sharing: they are the upper
bounds the memory allows. Nothing here imports torch; the extension only for group sizing.

KV cache groups: for a model whose layers mix full and sliding-window (or chunked) attention
(``layer_kinds``), :attr:`Plan.groups` is the group-aware pool
(:func:`pagedkv.config.size_groups`, grouping chosen for ``max_model_len``): pages of one size
shared by every group, the per-sequence need summed over groups, and per length the concurrency
against the analytic optimum (every layer holding exactly its own blocks), the token-exact bound,
full-attention accounting (the rows above, which count every layer whole) and the grouping whose
page holds the least numerous kind's layers (vLLM's).

The context: ``max_model_len`` defaults to the model's own ``max_position_embeddings`` (what a server
reserves per sequence), or to the longest planned length when that is longer or the model's is not
known. Planning beyond the model's context is allowed but recorded in :attr:`Plan.warnings`.

Invariants: :func:`make_plan` validates everything before computing and raises
:class:`pagedkv.errors.InvalidConfigError` / :class:`pagedkv.config.CapacityError` with a one-line
message; a :class:`Plan` it returns is internally consistent (every row uses the same pool).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from .config import CacheSpec, GroupSizing, MemoryBudget, format_bytes, size_groups
from .errors import InvalidConfigError

__all__ = ["Plan", "PlanRow", "make_plan", "format_plan", "plan_json", "parse_seq_lens",
           "kv_heads_per_rank", "shard_spec",
           "default_seq_lens", "DEFAULT_SEQ_LENS"]

#: Lengths compared when none are given (those shorter than the context, then the context itself).
DEFAULT_SEQ_LENS = (1024, 4096, 32768)


@dataclass(frozen=True)
class PlanRow:
    """Paged against contiguous concurrency for sequences of one length."""

    seq_len: int
    blocks_per_seq: int
    paged_max_seqs: int
    paged_waste_tokens_per_seq: int
    contiguous_max_seqs: int
    contiguous_waste_tokens_per_seq: int

    @property
    def ratio(self) -> Optional[float]:
        """Paged over contiguous concurrency; ``None`` when contiguous fits none."""
        if self.contiguous_max_seqs == 0:
            return None
        return self.paged_max_seqs / self.contiguous_max_seqs


@dataclass(frozen=True)
class Plan:
    """Everything ``pagedkv plan`` prints."""

    model: str
    spec: CacheSpec
    budget: MemoryBudget
    weights_source: str
    num_blocks: int
    max_model_len: int
    rows: tuple[PlanRow, ...]
    #: The model's trained context (``max_position_embeddings``), when known.
    model_max_len: Optional[int] = None
    #: Things the plan does although they are likely mistakes (one line each).
    warnings: tuple[str, ...] = ()
    #: The group-aware pool, for a model with sliding or chunked layers (else ``None``).
    groups: Optional[GroupSizing] = None

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block


def parse_seq_lens(text: str) -> list[int]:
    """``"1024,4096,32k"`` → ``[1024, 4096, 32768]`` (``k`` = 1024); each ≥ 1."""
    out = []
    for part in text.split(","):
        item = part.strip().lower()
        if not item:
            continue
        scale = 1
        if item.endswith("k"):
            item, scale = item[:-1], 1024
        try:
            value = int(item) * scale
        except ValueError:
            raise InvalidConfigError(f"sequence length {part.strip()!r} is not an integer") from None
        if value < 1:
            raise InvalidConfigError(f"sequence length must be >= 1, got {value}")
        out.append(value)
    if not out:
        raise InvalidConfigError(f"no sequence lengths in {text!r}")
    return out


def default_seq_lens(context: Optional[int]) -> list[int]:
    """The lengths ``pagedkv plan`` compares by default: :data:`DEFAULT_SEQ_LENS` below ``context``,
    then ``context`` itself (where paged and contiguous meet); all of them when it is unknown."""
    if context is None:
        return list(DEFAULT_SEQ_LENS)
    return [n for n in DEFAULT_SEQ_LENS if n < context] + [context]


def make_plan(
    spec: CacheSpec,
    budget: MemoryBudget,
    seq_lens: Sequence[int],
    max_model_len: Optional[int] = None,
    *,
    model: str = "custom",
    weights_source: str = "given",
    model_max_len: Optional[int] = None,
    layer_kinds: Optional[Sequence[Any]] = None,
) -> Plan:
    """Compute the pool and the per-length rows.

    ``layer_kinds`` (one attention kind per layer, e.g. :attr:`ModelConfig.layer_kinds`): when
    some layer is sliding or chunked, :attr:`Plan.groups` holds the group-aware pool, its
    grouping chosen for ``max_model_len``.

    ``max_model_len`` (the contiguous reservation per sequence) defaults to ``model_max_len`` — the
    model's ``max_position_embeddings`` — or to the longest of ``seq_lens`` when that is longer or
    the model's context is unknown: a contiguous reservation must hold the longest sequence planned
    for. A length above an explicit ``max_model_len`` is an error; a ``max_model_len`` above
    ``model_max_len`` is planned, with a line in :attr:`Plan.warnings`.
    """
    if not seq_lens:
        raise InvalidConfigError("seq_lens must name at least one length")
    for n in seq_lens:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidConfigError(f"sequence length must be an integer >= 1, got {n!r}")
    if model_max_len is not None and (
            isinstance(model_max_len, bool) or not isinstance(model_max_len, int) or model_max_len < 1):
        raise InvalidConfigError(f"model_max_len must be an integer >= 1, got {model_max_len!r}")
    if max_model_len is None:
        max_model_len = max(seq_lens) if model_max_len is None else max(model_max_len, max(seq_lens))
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise InvalidConfigError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
    too_long = [n for n in seq_lens if n > max_model_len]
    if too_long:
        raise InvalidConfigError(
            f"sequence length {too_long[0]} exceeds max_model_len {max_model_len}"
        )
    warnings = []
    if model_max_len is not None and max_model_len > model_max_len:
        warnings.append(
            f"max_model_len {max_model_len:,} exceeds the model's max_position_embeddings "
            f"{model_max_len:,}: positions past it were not trained (unless rope scaling extends them)"
        )
    num_blocks = budget.num_blocks(spec)
    capacity = num_blocks * spec.block_size
    contiguous = capacity // max_model_len
    rows = []
    for n in seq_lens:
        blocks = spec.blocks_for_tokens(n)
        rows.append(PlanRow(
            seq_len=n,
            blocks_per_seq=blocks,
            paged_max_seqs=num_blocks // blocks,
            paged_waste_tokens_per_seq=blocks * spec.block_size - n,
            contiguous_max_seqs=contiguous,
            contiguous_waste_tokens_per_seq=max_model_len - n,
        ))
    groups = None
    if layer_kinds is not None:
        sizing = size_groups(spec, layer_kinds, budget, max_model_len)
        if sizing.grouping.saves_memory:
            groups = sizing
    return Plan(model=model, spec=spec, budget=budget, weights_source=weights_source,
                num_blocks=num_blocks, max_model_len=max_model_len, rows=tuple(rows),
                model_max_len=model_max_len, warnings=tuple(warnings), groups=groups)


def _bytes_cell(n: int) -> str:
    if abs(n) < 1024:
        return f"{n:,} B"
    return f"{format_bytes(n)} ({n:,} B)"


def format_plan(plan: Plan) -> str:
    """The human-readable report: pool arithmetic, then one row per sequence length."""
    s, b = plan.spec, plan.budget
    if s.mla:
        shape = f"MLA, one latent of {s.head_dim} per token per layer"
        formula = f"1 latent × {s.head_dim} × {s.dtype_bytes} × {s.num_layers}"
    else:
        shape = f"{s.num_kv_heads} KV heads × head_dim {s.head_dim}"
        formula = f"2 × {s.num_kv_heads} × {s.head_dim} × {s.dtype_bytes} × {s.num_layers}"
    context = "" if plan.model_max_len is None else f"; model context {plan.model_max_len:,}"
    lines = [
        f"model             {plan.model}: {s.num_layers} layers, {shape}, {s.dtype}, "
        f"block size {s.block_size}",
        f"bytes per token   {_bytes_cell(s.bytes_per_token)}  = {formula}",
        f"bytes per block   {_bytes_cell(s.bytes_per_block)}",
        f"memory            {_bytes_cell(b.total_bytes)} × utilization {b.utilization} = "
        f"{format_bytes(b.usable_bytes)}",
        f"  − weights       {_bytes_cell(b.weights_bytes)} [{plan.weights_source}]",
        f"  − activations   {_bytes_cell(b.activation_peak_bytes)}",
        f"  − graph reserve {_bytes_cell(b.graph_reserve_bytes)}",
        f"  = KV budget     {_bytes_cell(b.kv_bytes)}",
        f"blocks            {plan.num_blocks:,}  (pool {format_bytes(plan.pool_bytes)})",
        f"token capacity    {plan.token_capacity:,}",
        f"max model len     {plan.max_model_len:,}  (contiguous reservation per sequence{context})",
        "",
    ]
    header = ("seq len", "blocks/seq", "paged seqs", "paged waste/seq",
              "contig seqs", "contig waste/seq", "paged/contig")
    table = [header]
    for r in plan.rows:
        ratio = "—" if r.ratio is None else f"{r.ratio:.1f}×"
        table.append((f"{r.seq_len:,}", f"{r.blocks_per_seq:,}", f"{r.paged_max_seqs:,}",
                      f"{r.paged_waste_tokens_per_seq:,}", f"{r.contiguous_max_seqs:,}",
                      f"{r.contiguous_waste_tokens_per_seq:,}", ratio))
    lines += _table(table)
    if plan.groups is not None:
        lines += [""] + _format_groups(plan)
    return "\n".join(lines)


def _table(table: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    out = []
    for i, row in enumerate(table):
        out.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _kind_label(kind: str, size: int) -> str:
    return kind if kind == "full" else f"{kind} {size:,}"


def _format_groups(plan: Plan) -> list[str]:
    """The group-aware section of the report."""
    g = plan.groups
    assert g is not None
    counts: dict[str, int] = {}
    for grp in g.groups:
        label = _kind_label(grp.kind, grp.size)
        counts[label] = counts.get(label, 0) + 1
    layers: dict[str, int] = {}
    for kind, size in g.layer_kinds:
        label = _kind_label(kind, size)
        layers[label] = layers.get(label, 0) + 1
    mix = ", ".join(f"{n} {label}" for label, n in layers.items())
    cut = ", ".join(f"{n} {label}" for label, n in counts.items())
    pad = "no padding" if not g.grouping.padding else f"{g.grouping.padding} padded slots"
    lines = [
        "KV cache groups (the table above counts every layer whole: full-attention accounting)",
        f"layers            {mix}",
        f"groups            {g.num_groups} of {g.grouping.slots} layers ({cut}), {pad}; "
        f"chosen for {g.context:,} tokens",
        f"bytes per token   {_bytes_cell(g.layer_bytes_per_token)} a layer, "
        f"{_bytes_cell(g.layer_bytes_per_token * g.grouping.slots)} a group",
        f"bytes per page    {_bytes_cell(g.page_bytes)}  = {g.grouping.slots} layers × "
        f"{g.block_size} tokens",
        f"pages             {g.num_blocks:,}  (pool {format_bytes(g.pool_bytes)}; "
        f"{g.full_num_blocks:,} full-attention blocks in the same memory)",
        "",
    ]
    header = ("seq len", "pages/seq", "seqs", "full-attn seqs", "gain", "optimum seqs",
              "of optimum", "of token bound", "smallest-kind pages")
    table = [header]
    for r in plan.rows:
        n = r.seq_len
        full = g.full_max_seqs(n)
        gain = "—" if full == 0 else f"{g.max_seqs(n) / full:.1f}×"
        table.append((f"{n:,}", f"{g.blocks_per_seq(n):,}", f"{g.max_seqs(n):,}", f"{full:,}", gain,
                      f"{g.optimum_seqs(n):,.2f}", f"{g.efficiency(n):.1%}",
                      f"{g.token_efficiency(n):.1%}", f"{g.smallest_kind_page_efficiency(n):.1%}"))
    lines += _table(table)
    lines.append("of optimum: pages / pages per sequence over the optimum's sequences (every layer "
                 "holding exactly its own blocks); smallest-kind pages: the same for pages of the "
                 "least numerous kind's layer count (vLLM's grouping)")
    return lines


def plan_json(plan: Plan) -> str:
    """The plan as one JSON object (sizes in bytes)."""
    s, b = plan.spec, plan.budget
    obj = {
        "model": plan.model,
        "spec": asdict(s),
        "bytes_per_token": s.bytes_per_token,
        "bytes_per_block": s.bytes_per_block,
        "total_bytes": b.total_bytes,
        "utilization": b.utilization,
        "usable_bytes": b.usable_bytes,
        "weights_bytes": b.weights_bytes,
        "weights_source": plan.weights_source,
        "activation_peak_bytes": b.activation_peak_bytes,
        "graph_reserve_bytes": b.graph_reserve_bytes,
        "kv_budget_bytes": b.kv_bytes,
        "num_blocks": plan.num_blocks,
        "pool_bytes": plan.pool_bytes,
        "token_capacity": plan.token_capacity,
        "max_model_len": plan.max_model_len,
        "model_max_len": plan.model_max_len,
        "warnings": list(plan.warnings),
        "rows": [dict(asdict(r), ratio=r.ratio) for r in plan.rows],
        "groups": (None if plan.groups is None
                   else plan.groups.as_dict([r.seq_len for r in plan.rows])),
    }
    return json.dumps(obj, indent=2)



# ------------------------------------------------------------------ tensor parallelism, per rank


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each tensor-parallel rank's pool holds.

    ``num_kv_heads / tp`` when ``tp`` divides the heads; ``1`` when there are fewer heads than
    ranks and ``num_kv_heads`` divides ``tp`` (each head is then replicated on
    ``tp / num_kv_heads`` ranks, as vLLM does). Every rank holds the same number of heads, so
    every rank's pool has the same bytes per block and one block manager serves them all.

    Raises:
        InvalidConfigError: ``tp`` is not an int >= 1, or neither of the two divides the other.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or (
            tensor_parallel_size < 1):
        raise InvalidConfigError(
            f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}",
            field="tensor_parallel_size", value=tensor_parallel_size, reason="must be >= 1")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise InvalidConfigError(f"num_kv_heads must be an integer >= 1, got {num_kv_heads!r}",
                                 field="num_kv_heads", value=num_kv_heads, reason="must be >= 1")
    tp = tensor_parallel_size
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise InvalidConfigError(
                f"tensor_parallel_size {tp} does not divide the {num_kv_heads} KV heads",
                field="tensor_parallel_size", value=tp, reason="must divide num_kv_heads")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise InvalidConfigError(
            f"{num_kv_heads} KV heads cannot be replicated evenly over tensor_parallel_size {tp}",
            field="tensor_parallel_size", value=tp,
            reason="num_kv_heads must divide it when smaller")
    return 1


def shard_spec(spec: CacheSpec, tensor_parallel_size: int) -> CacheSpec:
    """One tensor-parallel rank's cache spec: ``spec`` with :func:`kv_heads_per_rank` heads.

    Plan a TP deployment with it: :func:`make_plan` on the shard spec and one GPU's budget gives
    the blocks of each rank's pool (all ranks hold the same blocks, for their own heads). An MLA
    spec's one latent is shared by every head, so each rank holds it whole.
    """
    from dataclasses import replace

    if spec.mla:
        kv_heads_per_rank(1, tensor_parallel_size)  # validates tp
        return spec
    return replace(spec, num_kv_heads=kv_heads_per_rank(spec.num_kv_heads, tensor_parallel_size))
