"""Which KV cache group each layer of a model belongs to, and where in a page its KV lives.

Owns :func:`layer_kinds` (each layer's attention kind, read from a Hugging Face config),
:class:`LayerGrouping` and :func:`group_layers` (the layers cut into KV cache groups of one page
size). The manager (``groups=``) and the KV pool both follow a grouping: group ``g``'s block ``b``
is page ``b`` of the one pool, and its ``j``-th layer's K and V live in that page's slot ``j``.

Design. All groups draw pages from one pool, so a page must hold one group's layers for
``block_size`` tokens. Every group therefore holds the same number of layers, :attr:`slots`
(``m``); a kind with ``n`` layers gets ``ceil(n / m)`` groups, and the last one's unused slots are
padding. :func:`group_layers` picks ``m`` to minimize the KV a sequence of ``context`` tokens
needs, padding included, under the manager's group limit (ties: fewer groups). Gemma-3-27B (10
full and 52 sliding layers) gets ``m = 2``: 31 groups and no padding, where one 10-layer page
(vLLM's grouping) pads 8 sliding layers.

Invariants:

* Group 0 is full whenever some layer is (the manager's rule: group 0 carries the prefix-hash
  chain, and a windowed group 0 is for models without a full layer). A model whose every layer is
  windowed (Mistral-7B-v0.1's sliding window on every layer, a Qwen2 config whose
  ``max_window_layers`` leaves no layer full, Llama 4 with every layer chunked) gets groups of its
  windowed kinds only, group 0 among them: a sequence holds its window's blocks, not its whole
  length. With ``windowed_group0=False`` (what a host, disk or remote tier of the prefix cache
  needs: they follow group 0's leading run of blocks) such a model runs as one full group instead,
  correct since the kernels skip keys outside each layer's window, but holding every position.
* Every layer is in exactly one group and one slot; groups of one kind are consecutive; a
  group's layers are ascending, and only a kind's last group can have padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import InvalidConfigError
from .groups import KVCacheGroup, peak_decode_blocks

__all__ = ["LayerGrouping", "layer_kinds", "group_layers", "MAX_GROUPS"]

#: Most KV cache groups one manager holds (the core's ``MAX_GROUPS``).
MAX_GROUPS = 64

_FULL = KVCacheGroup.full()

#: Model type -> the sliding-window pattern transformers fills ``layer_types`` from when a config
#: has none (every ``n``-th layer full; ``sliding_window_pattern`` in the config overrides it).
_DEFAULT_PATTERNS = {"gemma3": 6, "gemma3_text": 6, "gpt_oss": 2}
#: Llama 4 model types: their ``layer_types`` default comes from ``no_rope_layers``.
_LLAMA4 = ("llama4", "llama4_text")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(f"{name} = {value!r}: must be an int >= 1 (tokens)")
    return value


def layer_kinds(cfg: Any) -> List[KVCacheGroup]:
    """Each decoder layer's attention kind, from a Hugging Face config (a mapping such as a
    ``config.json``, or a ``PretrainedConfig``).

    Read, in order: ``layer_types`` (``"full_attention"`` / ``"attention"``,
    ``"sliding_attention"`` with ``sliding_window``, ``"chunked_attention"`` with
    ``attention_chunk_size``); else what transformers derives for the model type when a
    ``config.json`` has no ``layer_types`` (:data:`_DEFAULT_PATTERNS`: Gemma 3 every 6th layer full
    unless ``sliding_window_pattern`` says otherwise, gpt-oss every 2nd; Llama 4's
    ``no_rope_layers``: its RoPE layers chunked, default every 4th layer NoPE and full); else
    ``sliding_window`` on every layer (Mistral), honouring ``use_sliding_window``, Qwen2's
    ``max_window_layers`` (layers from that index on slide) and an older config's
    ``sliding_window_pattern`` (every ``n``-th layer full); else all full. A multimodal config's
    ``text_config`` is read in its place. A raw ``config.json`` and the ``PretrainedConfig``
    transformers builds from it give the same kinds.

    Raises:
        InvalidConfigError: No ``num_hidden_layers``, a ``layer_types`` of another length or with
            an unknown entry, or a window or chunk that is not an int >= 1.
    """
    text = _get(cfg, "text_config")
    if text is not None and _get(cfg, "num_hidden_layers") is None:
        cfg = text
    layers = _get(cfg, "num_hidden_layers")
    _positive("num_hidden_layers", layers)
    types = _get(cfg, "layer_types")
    window = _get(cfg, "sliding_window")
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != layers:
            raise InvalidConfigError(
                f"layer_types must list one kind per layer ({layers}), got {types!r}"[:300]
            )
        out = []
        for i, t in enumerate(types):
            if t in ("full_attention", "attention"):
                out.append(_FULL)
            elif t == "sliding_attention":
                out.append(KVCacheGroup.sliding(_positive("sliding_window", window)))
            elif t == "chunked_attention":
                chunk = _positive("attention_chunk_size", _get(cfg, "attention_chunk_size"))
                out.append(KVCacheGroup.chunked(chunk))
            else:
                raise InvalidConfigError(
                    f"layer_types[{i}] = {t!r}: not an attention layer this package knows "
                    "(full_attention, sliding_attention, chunked_attention)"
                )
        return out
    model_type = _get(cfg, "model_type")
    if model_type in _LLAMA4 and _get(cfg, "attention_chunk_size") is not None:
        chunked = KVCacheGroup.chunked(
            _positive("attention_chunk_size", _get(cfg, "attention_chunk_size")))
        rope = _get(cfg, "no_rope_layers")
        if not rope:
            every = _positive("no_rope_layer_interval", _get(cfg, "no_rope_layer_interval", 4))
            rope = [int((i + 1) % every != 0) for i in range(layers)]
        if not isinstance(rope, (list, tuple)) or len(rope) != layers:
            raise InvalidConfigError(
                f"no_rope_layers must list one flag per layer ({layers}), got {rope!r}"[:300])
        return [chunked if flag else _FULL for flag in rope]
    if window and _get(cfg, "use_sliding_window", True):
        sliding = KVCacheGroup.sliding(_positive("sliding_window", window))
        pattern = _get(cfg, "sliding_window_pattern", _DEFAULT_PATTERNS.get(model_type))
        first = _get(cfg, "max_window_layers", 0) if _get(cfg, "model_type") in (
            "qwen2", "qwen2_moe", "qwen3", "qwen3_moe") else 0
        out = []
        for i in range(layers):
            full = i < first or (pattern and (i + 1) % int(pattern) == 0)
            out.append(_FULL if full else sliding)
        return out
    return [_FULL] * layers


def _need(kind: KVCacheGroup, context: int, block_size: int) -> int:
    """Blocks a layer of ``kind`` holds for a sequence at ``context`` tokens (its peak: the
    core's :func:`pagedkv.groups.peak_decode_blocks`)."""
    return peak_decode_blocks(kind, context, block_size)


@dataclass(frozen=True)
class LayerGrouping:
    """Layers cut into KV cache groups that share one page size.

    Attributes:
        groups: Each group's kind, group 0 full unless no layer is: what
            ``BlockManager(groups=)`` takes.
        group_layers: Each group's model layers, ascending (fewer than :attr:`slots` only in a
            kind's last group).
        slots: Layers a page holds (every group's size, padding included).
        layer_group: Each model layer's group.
        layer_slot: Each model layer's slot in its group's pages.
    """

    groups: Tuple[KVCacheGroup, ...]
    group_layers: Tuple[Tuple[int, ...], ...]
    slots: int
    layer_group: Tuple[int, ...]
    layer_slot: Tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def padding(self) -> int:
        """Page slots no layer uses."""
        return self.slots * len(self.groups) - len(self.layer_group)

    @property
    def saves_memory(self) -> bool:
        """Whether some group releases blocks (False for a one-full-group grouping)."""
        return any(g.kind != "full" for g in self.groups)

    def need_blocks(self, context: int, block_size: int) -> int:
        """Pages one sequence of ``context`` tokens holds at its peak, summed over groups."""
        return sum(_need(g, context, block_size) for g in self.groups)

    def efficiency(self, kinds: Sequence[KVCacheGroup], context: int, block_size: int) -> float:
        """The analytic optimum's per-sequence KV (every layer holding exactly its own blocks)
        over this grouping's, padding included: the share of the optimum's concurrency reached."""
        ideal = sum(_need(k, context, block_size) for k in kinds)
        return ideal / (self.need_blocks(context, block_size) * self.slots)


def _cut(kinds: Sequence[KVCacheGroup], m: int) -> LayerGrouping:
    by_kind: Dict[KVCacheGroup, List[int]] = {}
    for i, k in enumerate(kinds):
        by_kind.setdefault(k, []).append(i)
    order = sorted(by_kind, key=lambda k: (k.kind != "full", k.kind, k.size))
    groups: List[KVCacheGroup] = []
    members: List[Tuple[int, ...]] = []
    for k in order:
        ls = by_kind[k]
        for s in range(0, len(ls), m):
            groups.append(k)
            members.append(tuple(ls[s : s + m]))
    layer_group = [0] * len(kinds)
    layer_slot = [0] * len(kinds)
    for g, members_g in enumerate(members):
        for j, layer in enumerate(members_g):
            layer_group[layer], layer_slot[layer] = g, j
    return LayerGrouping(tuple(groups), tuple(members), m, tuple(layer_group), tuple(layer_slot))


def group_layers(
    kinds: Sequence[KVCacheGroup],
    context: int,
    block_size: int,
    *,
    max_groups: int = MAX_GROUPS,
    windowed_group0: bool = True,
) -> LayerGrouping:
    """The grouping of ``kinds`` (one per layer, e.g. from :func:`layer_kinds`) whose sequences
    of ``context`` tokens need the least KV, within ``max_groups`` groups (ties: fewer groups).

    A model without a full layer gets groups of its windowed kinds, group 0 windowed; with
    ``windowed_group0=False`` one full group of every layer instead (see the module doc).

    Raises:
        InvalidConfigError: No layers, an entry that is not a :class:`KVCacheGroup`, or a
            ``context`` / ``block_size`` / ``max_groups`` that is not an int >= 1.
    """
    kinds = list(kinds)
    if not kinds or not all(isinstance(k, KVCacheGroup) for k in kinds):
        raise InvalidConfigError("kinds must list each layer's KVCacheGroup (at least one)")
    _positive("context", context)
    _positive("block_size", block_size)
    _positive("max_groups", max_groups)
    if not isinstance(windowed_group0, bool):
        raise InvalidConfigError(f"windowed_group0 = {windowed_group0!r}: must be a bool")
    windowed = [k.kind != "full" for k in kinds]
    if not any(windowed) or (all(windowed) and not windowed_group0):
        return _cut([_FULL] * len(kinds), len(kinds))
    best: Optional[Tuple[int, int, int]] = None
    for m in range(1, len(kinds) + 1):
        g = _cut(kinds, m)
        if g.num_groups > max_groups:
            continue
        key = (g.need_blocks(context, block_size) * m, g.num_groups, m)
        if best is None or key < best:
            best = key
    if best is None:
        raise InvalidConfigError(
            f"the model's {len(set(kinds))} attention kinds need more than {max_groups} groups"
        )
    return _cut(kinds, best[2])
