"""Which record leaves the disk tier's host cache (ES-MoE §4.1: the cache follows the known order).

Training: the engine hands the store its schedule (`set_schedule`: this pass in order, the backward in reverse, the
next step's passes), and the idle record needed furthest in the future goes (Belady's MIN), least recently used first
among equals and without a schedule. Decoding (`decode`, offload/inference/policies.py): decoding's frequency scores and
per-layer budgets choose instead. Pinned records (ES-MoE §4.3) go only when nothing else can. All calls are made with
the store's lock held.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable

from .store import ExpertKey


class EvictionPolicy:
    def __init__(self):
        self.schedule: list[ExpertKey] = []
        self.cursor = 0  # the schedule's next acquisition
        self._uses: dict[ExpertKey, deque[int]] = {}  # each expert's positions in the schedule
        self.decode = None  # a DecodeCache while the engine decodes (`set_decode_cache`)

    def set_schedule(self, keys: list[ExpertKey]) -> None:
        uses: dict[ExpertKey, deque[int]] = {}
        for i, key in enumerate(keys):
            uses.setdefault(key, deque()).append(i)
        self.schedule, self._uses, self.cursor = list(keys), uses, 0

    def advance(self, key: ExpertKey) -> None:
        """A use of `key`: when it is the schedule's next, the schedule moves on."""
        if self.cursor < len(self.schedule) and self.schedule[self.cursor] == key:
            self._uses[key].popleft()
            self.cursor += 1

    def next_use(self, key: ExpertKey) -> float:
        uses = self._uses.get(key)
        return uses[0] if uses else math.inf

    def not_needed_within(self, key: ExpertKey, acquisitions: int) -> bool:
        """Whether the schedule needs `key` again only after `acquisitions` more acquisitions (or never)."""
        return self.next_use(key) - self.cursor > acquisitions

    @property
    def training(self) -> bool:
        """A training schedule is set and no decoding policy overrides it."""
        return bool(self.schedule) and self.decode is None

    def victim(self, idle: list[ExpertKey], cached: Iterable[ExpertKey], pinned: set[ExpertKey],
               evict_pinned: bool, for_key: ExpertKey | None = None, speculative: bool = False) -> ExpertKey | None:
        """Among the `idle` records (least recently used first; `cached`: every record in the cache), the one to evict:
        not pinned if possible (pinned only when `evict_pinned`). A `speculative` read for `for_key` evicts only one
        needed later than `for_key`, or nothing (the cache is better used as it is)."""
        if self.decode is not None:
            held = Counter(k[0] for k in cached)
            victim = self.decode.victim([k for k in idle if k not in pinned], held, for_key, speculative)
            if victim is None and evict_pinned:
                victim = self.decode.victim([k for k in idle if k in pinned], held, for_key, speculative)
            return victim
        best, best_use, best_pinned, pinned_use = None, -1.0, None, -1.0
        for key in idle:
            use = self.next_use(key)
            if key not in pinned:
                if use > best_use:
                    best, best_use = key, use
            elif use > pinned_use:
                best_pinned, pinned_use = key, use
        if best is None and evict_pinned:
            best, best_use = best_pinned, pinned_use
        if best is not None and speculative and best_use != math.inf and best_use <= self.next_use(for_key):
            return None
        return best


__all__ = ["EvictionPolicy"]
