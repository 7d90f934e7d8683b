"""Offloaded inference (generation, evaluation): what the engine does when no backward follows.

Training knows its order exactly (forward, reverse backward, steps: the disk tier's Belady eviction). Decoding does
not: each token routes to a few experts per layer, and the hot set drifts slowly. Three parts, after the inference
offloading systems mixtral-offloading, MoE-Infinity, Pre-gated MoE and Fiddler:

- `DecodeCache`: the disk tier's eviction while decoding: a score per expert, its use frequency with exponential
  decay per token, and a budget per layer (`capacity // layers`) so that one layer's hot experts cannot push every
  other layer's out (the idea of mixtral-offloading's per-layer expert caches and MoE-Infinity's activation-aware
  cache, here as one policy over the store's existing cache records).
- `PreGate`: while layer l runs, layer l+1's router applied to layer l's router input guesses the experts layer l+1
  will pick (Pre-gated MoE; mixtral-offloading's speculative expert loading), helped by how often each expert
  followed the token's layer-l experts so far (MoE-Infinity's activation tracing) and by the experts layer l+1 picked
  for the previous token (mixtral-offloading), each source weighted by its own recent hit rate; their reads start at
  once.
  The guess only decides what is read early: outputs never depend on it. Its hit rate is counted.
- `PlacementCostModel`: on an asynchronous device, an expert that is not on the device and has few tokens is cheaper
  to run on the host, where its weights are, than to upload (Fiddler). The decision compares
  tokens x FLOPs / host speed (+ moving the activations) with weight bytes / link bandwidth, both measured once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..stores.store import ExpertKey
from ..telemetry import OffloadStats

logger = logging.getLogger(__name__)


class DecodeCache:
    """Eviction scores for decoding: frequency with exponential decay per token, a budget of cache records per layer."""

    def __init__(self, num_layers: int, capacity: int, decay: float = 0.9):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"the decode cache's decay must be in (0, 1], got {decay}")
        self.num_layers = num_layers
        self.capacity = capacity
        self.budget = max(1, capacity // max(1, num_layers))  # cache records a layer keeps under pressure
        self.decay = decay
        self.tick = 0  # tokens (forward passes) so far
        self._score: dict[ExpertKey, tuple[float, int]] = {}  # key -> (score, tick it was last brought up to)
        self._expected: dict[ExpertKey, int] = {}  # read ahead (stream lookahead, pre-gating) at this tick, unused yet

    def next_token(self) -> None:
        self.tick += 1

    def score(self, key: ExpertKey) -> float:
        value, at = self._score.get(key, (0.0, self.tick))
        return value * self.decay ** (self.tick - at)

    def touch(self, key: ExpertKey) -> None:
        self._score[key] = (self.score(key) + 1.0, self.tick)
        self._expected.pop(key, None)

    def expect(self, key: ExpertKey) -> None:
        """`key` is being read ahead for this token: evicted last until it is used (or the token ends), else a
        fresh read, whose score is still low, would be the first victim of the next miss."""
        self._expected[key] = self.tick

    def expecting(self, key: ExpertKey) -> bool:
        """Whether `key` was read ahead for this token and not used yet."""
        return self._expected.get(key) == self.tick

    def _rank(self, key: ExpertKey) -> tuple[bool, float]:
        return self.expecting(key), self.score(key)

    def victim(self, idle: Iterable[ExpertKey], held: Counter, incoming: ExpertKey | None,
               speculative: bool) -> ExpertKey | None:
        """Which of the `idle` cached experts to evict for `incoming`, given how many cache records each layer `held`s
        (counting `incoming`'s). A layer over its budget gives first: the incoming layer's own coldest expert when it
        is over, else the coldest of the other layers over budget. A blocking read then takes the coldest of all; a
        speculative one (a guess) takes nothing from a layer within its budget. Within the chosen pool, experts read
        ahead for this token and not used yet go last."""
        idle = list(idle)
        if not idle:
            return None
        layer = incoming[0] if incoming is not None else None
        pool: list[ExpertKey] = []
        if layer is not None and held[layer] > self.budget:
            pool = [k for k in idle if k[0] == layer]
        if not pool:
            pool = [k for k in idle if held[k[0]] > self.budget]
        if not pool:
            if speculative:
                return None
            pool = idle
        return min(pool, key=self._rank)


@dataclass
class Router:
    """One MoE layer's router weight (E, d) and its (E,) bias if any, named on their module: read at each use, so a
    checkpoint loaded after offload was enabled (weights replaced on the module) is what guesses."""

    module: nn.Module
    weight: str
    bias: str | None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = getattr(self.module, self.weight)
        bias = getattr(self.module, self.bias).to(w.dtype) if self.bias is not None else None
        return F.linear(hidden.to(w.dtype), w, bias)


def find_router(block: nn.Module, experts: nn.Module, num_experts: int, hidden_size: int) -> Router | None:
    """The router of one MoE block: the one (E, d) parameter of `block` outside `experts`, with its module's (E,)
    bias (a parameter or buffer with "bias" in its name) if any. One generic rule for every family (Mixtral's `gate`,
    Qwen3-MoE's router, gpt-oss's `router`, DeepSeek's gate with its score-correction bias, MoE-GPT's router); None
    when there is not exactly one such parameter."""
    found = []
    for module in block.modules():
        if module is experts or any(module is m for m in experts.modules()):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 2 and tuple(p.shape) == (num_experts, hidden_size):
                found.append((module, name))
    if len(found) != 1:
        return None
    module, weight = found[0]
    bias = None
    for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if t.dim() == 1 and t.shape[0] == num_experts and "bias" in name:
            bias = name
    return Router(module, weight, bias)


class PreGate:
    """Guesses layer l+1's experts while layer l runs (see the module docstring) and counts the hits.

    Three sources each give a distribution over layer l+1's experts for a token:
    - "router": layer l+1's router applied to the token's layer-l router input (softmax; Pre-gated MoE,
      mixtral-offloading): right where the hidden state changes little between layers;
    - "co-activation": how often each expert of layer l+1 followed the token's layer-l experts so far in this run (an
      online count, the "expert activation matrix" of MoE-Infinity): right where routing is consistent across layers;
    - "previous token": the experts layer l+1 picked for the previous token (mixtral-offloading's observation that
      consecutive tokens share experts): right where the text repeats itself.
    Which source is right depends on the model: replayed on one decode (`benchmarks/generate.py --analyze`), the
    co-activation count holds 0.81 of the routed experts on the main job's trained model and the previous token's
    experts 0.49, while on a random Qwen3-MoE it is 0.68 against 0.71; a fixed sum that helped one model (the
    previous token's experts at half weight: 0.70 -> 0.77 on the random one) hurt the other (0.80 -> 0.63). So the
    guess is the top-k of their sum, each weighted by its own recent hit rate (each source's top-k guess is scored
    too) raised to `sharpness` (16): in effect the source that has been right lately leads and the others break its
    ties (0.76 and 0.80 on those two traces).
    A wrong guess costs a read and may evict an expert that was needed, so the guesses are acted on only while their
    recent hit rate (`recent`, an exponential average over calls) is at least `min_hit_rate`; they are still made and
    scored meanwhile, so acting resumes when the model's routing becomes predictable again."""

    SOURCES = ("router", "co-activation", "previous token")

    def __init__(self, routers: list[Router | None], stats: OffloadStats,
                 min_hit_rate: float = 0.5, smoothing: float = 0.1, sharpness: float = 16.0):
        self.routers = routers
        self.stats = stats  # pregate_hits / pregate_routed
        self.min_hit_rate = min_hit_rate
        self.smoothing = smoothing
        self.sharpness = sharpness
        self.recent = 1.0  # optimistic start: act on the first guesses
        self.source_recent = dict.fromkeys(self.SOURCES, 0.5)  # each source's own recent hit rate
        self.guesses: dict[int, set[int]] = {}  # layer -> experts guessed for its next call
        self.source_guesses: dict[int, dict[str, set[int]]] = {}  # layer -> each source's own guess for it
        self.coactivation: dict[int, torch.Tensor] = {}  # layer l -> (E_l, E_l+1) counts of (i at l, j at l+1)
        self.previous: dict[int, torch.Tensor] = {}  # layer -> (T, E) choices of its last call
        self._last_layer: int | None = None  # the layer observed last

    @property
    def acting(self) -> bool:
        return self.recent >= self.min_hit_rate

    def _score(self, recent: float, hits: int, routed: int) -> float:
        return recent + self.smoothing * (hits / routed - recent)

    def _just_routed(self, layer: int) -> torch.Tensor | None:
        """(T, E) choices of `layer`'s last call if it was the last call observed (its tokens go on to layer + 1)."""
        return self.previous.get(layer) if self._last_layer == layer else None

    def observe(self, layer: int, top_k_index: torch.Tensor, num_experts: int) -> set[int]:
        """Layer `layer` routed its tokens to `top_k_index` (T, k): score its guess (and each source's), count
        co-activations with the previous layer's call over the same tokens; returns the routed experts. (Few tensor
        ops: this runs for every layer of every decoded token.)"""
        idx = top_k_index.reshape(-1, top_k_index.shape[-1])
        routed = {e for row in idx.tolist() for e in row if 0 <= e < num_experts}
        guess = self.guesses.pop(layer, None)
        if guess is not None and routed:
            hits = len(routed & guess)
            self.stats.pregate_hits += hits
            self.stats.pregate_routed += len(routed)
            self.recent = self._score(self.recent, hits, len(routed))
            for name, own in self.source_guesses.pop(layer, {}).items():
                self.source_recent[name] = self._score(self.source_recent[name], len(routed & own), len(routed))
        # (T, E) multi-hot of each token's experts; a dropped choice (id E, in families that drop) lands in the
        # extra column, which is cut off.
        chosen = torch.zeros(idx.shape[0], num_experts + 1, device=idx.device)
        chosen = chosen.scatter_(1, idx.long().clamp(0, num_experts), 1.0)[:, :num_experts]
        last = self._just_routed(layer - 1)
        if last is not None and last.shape[0] == chosen.shape[0]:
            counts = self.coactivation.get(layer - 1)
            if counts is None:
                counts = self.coactivation[layer - 1] = chosen.new_zeros(last.shape[1], num_experts)
            counts.addmm_(last.t(), chosen)
        self._last_layer = layer
        self.previous[layer] = chosen
        return routed

    def _distributions(self, layer: int, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each available source's (T, E) distribution over `layer`'s experts (each token's sums to 1, or 0 with no
        data)."""
        out = {"router": self.routers[layer].logits(hidden).softmax(-1, dtype=torch.float32)}
        counts, last = self.coactivation.get(layer - 1), self._just_routed(layer - 1)
        if counts is not None and last is not None:
            followed = last @ counts  # (T, E): how often each expert followed the token's experts
            out["co-activation"] = followed / followed.sum(-1, keepdim=True).clamp_min(1.0)
        previous = self.previous.get(layer)
        if previous is not None and previous.shape[0] == hidden.shape[0]:  # the same tokens (of a batch)
            out["previous token"] = previous / previous.sum(-1, keepdim=True).clamp_min(1.0)
        return out

    def guess(self, layer: int, hidden: torch.Tensor, top_k: int) -> list[int]:
        """The experts layer `layer` is expected to pick for the tokens whose previous-layer router input is
        `hidden` (their previous-layer choices: the last `observe`), most chosen first; [] when that layer has no
        router found."""
        if layer >= len(self.routers) or self.routers[layer] is None:
            return []
        dists = self._distributions(layer, hidden.reshape(-1, hidden.shape[-1]))
        k = min(top_k, dists["router"].shape[-1])
        score, own = None, {}
        for name, dist in dists.items():
            own[name] = set(dist.topk(k, dim=-1).indices.reshape(-1).tolist())
            weighted = dist * self.source_recent[name] ** self.sharpness
            score = weighted if score is None else score.add_(weighted)
        self.source_guesses[layer] = own
        picked = score.topk(k, dim=-1).indices.tolist()
        tally = Counter(e for row in picked for e in row)
        order = [e for e, _ in tally.most_common()]
        self.guesses[layer] = set(order)
        return order


@dataclass
class PlacementCostModel:
    """Fiddler's choice for an expert that is not on the device: run it on the host where its weights are, or
    upload the weights. Speeds in FLOP/s and bytes/s; `measure` takes them once on this machine."""

    host_flops: float
    link_bytes_per_s: float

    def host_seconds(self, tokens: int, flops_per_token: float, activation_bytes_per_token: float) -> float:
        # The expert's FLOPs on the host, plus its tokens' inputs down and their outputs back up.
        return tokens * flops_per_token / self.host_flops + 2 * tokens * activation_bytes_per_token / self.link_bytes_per_s

    def upload_seconds(self, weight_bytes: int) -> float:
        return weight_bytes / self.link_bytes_per_s

    def compute_on_host(self, tokens: int, flops_per_token: float, weight_bytes: int,
                        activation_bytes_per_token: float) -> bool:
        return self.host_seconds(tokens, flops_per_token, activation_bytes_per_token) < self.upload_seconds(weight_bytes)

    def max_host_tokens(self, flops_per_token: float, weight_bytes: int, activation_bytes_per_token: float) -> int:
        """The most tokens for which the host wins (0: never)."""
        per_token = flops_per_token / self.host_flops + 2 * activation_bytes_per_token / self.link_bytes_per_s
        return max(0, math.ceil(self.upload_seconds(weight_bytes) / per_token) - 1)

    @classmethod
    def measure(cls, runtime, numel: int, dtype: torch.dtype, tokens: int = 8,
                repeats: int = 5) -> "PlacementCostModel":
        """Host speed from a (tokens x n) @ (n x n) matmul in `dtype` of about one expert's size; link speed from
        copies of an expert-sized page-locked buffer to the device (best of `repeats`)."""
        n = max(64, int(math.isqrt(numel // 2)))
        a, b = torch.randn(tokens, n).to(dtype), torch.randn(n, n).to(dtype)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        host_flops = 2 * tokens * n * n / max(best, 1e-9)
        src = runtime.pinned_empty((numel,), dtype)
        dst = runtime.empty((numel,), dtype, persistent=True)
        best = math.inf
        for _ in range(repeats):
            runtime.record().synchronize()
            t0 = time.perf_counter()
            runtime.copy_(dst, src)
            runtime.record().synchronize()
            best = min(best, time.perf_counter() - t0)
        link = numel * src.element_size() / max(best, 1e-9)
        logger.info("compute-on-host cost model: host %.1f GFLOP/s, link %.1f GB/s", host_flops / 1e9, link / 1e9)
        return cls(host_flops=host_flops, link_bytes_per_s=link)


__all__ = ["DecodeCache", "PlacementCostModel", "PreGate", "Router", "find_router"]
