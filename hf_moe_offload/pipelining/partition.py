"""Partitioned (micro-batch) execution of one MoE layer along the token dimension (MPMoE §3.2).

One MoE layer, from plan to output, with n partitions:

    full DispatchPlan (rows sorted by expert)
      -> split_plan: partition p owns the rows whose source token lies in [bounds[p], bounds[p+1]) (expert order kept)
      -> for each p:  comm.dispatch (T_DI) -> experts (T_M, T_DO) -> weighting -> comm.combine -> index_add_ into T_O
         with the partition's saved tensors handled by a `PartitionSaver` (restore strategy, memory reuse §3.3)

Overlap: on CUDA, dispatch of partition p+1 and combine of partition p run on a side stream while partition p's
experts run on the current stream (events order them); host copies of S1-S3 use their own stream
(`restore.HostCopier`). On CPU, host copies run on a background thread, and a stage whose exchanges are asynchronous
collectives (gloo) returns them `Pending`: dispatch of p+1 and combine of p are in flight while the experts of p
(and p+1) compute, and are waited for only when their rows are needed. The local dispatch runs inline.

The communication stage is pluggable (`CommStage`): `LocalComm` (single process, dispatch = index_select) here;
with expert parallelism (`hf_moe_offload.distributed`), `AllToAllComm` (static EP / ES-MoE dynamic placement: one
micro all-to-all per partition, MPMoE §3.2.2 Fig. 5b) and `PPMoEComm` (index-select + all-reduce, PPMoE §3.3), in
`distributed/comm_stages.py`. `enable_micro_batch_pipelining` picks the stage of a model's expert parallelism itself.
The expert-side weighting is why `Dispatched` carries the weights of the received rows. Re-dispatch in backward
(S2/S4) is then a collective: every rank restores its partitions in the same (reverse) order, which autograd's
deterministic scheduling of the same graph guarantees.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..runtime import runtime_for
from .restore import HostCopier, PartitionSaver, RestoreStrategy, SavedBytes, restore_strategy

logger = logging.getLogger(__name__)


@dataclass
class PartPlan:
    """The rows of a DispatchPlan whose source token lies in one partition (same fields as `DispatchPlan`)."""

    token_index: torch.Tensor  # (N_p,) source token of each row, sorted by expert
    weights: torch.Tensor  # (N_p,) fp32 combine weights
    counts: list[int]  # rows per expert, length E
    index: int = 0  # which partition (0..n-1)


def partition_bounds(num_tokens: int, n: int) -> list[int]:
    """Token boundaries of n nearly equal partitions (n need not divide num_tokens)."""
    return [(p * num_tokens) // n for p in range(n + 1)]


def split_plan(plan, num_tokens: int, n: int) -> list[PartPlan]:
    """Split a DispatchPlan by source token into n partitions, keeping expert order inside each (one host sync)."""
    if n == 1:
        return [PartPlan(plan.token_index, plan.weights, list(plan.counts))]
    E = len(plan.counts)
    device = plan.token_index.device
    bounds = torch.tensor(partition_bounds(num_tokens, n)[1:-1], device=device)
    part = torch.bucketize(plan.token_index, bounds, right=True)  # (N,) partition of each row
    expert = torch.repeat_interleave(torch.arange(E, device=device), torch.tensor(plan.counts, device=device))
    counts = torch.bincount(part * E + expert, minlength=n * E).view(n, E).tolist()
    order = torch.argsort(part, stable=True)  # stable: rows stay sorted by expert inside a partition
    parts, start = [], 0
    for p in range(n):
        rows = order[start : start + sum(counts[p])]
        start += sum(counts[p])
        parts.append(PartPlan(plan.token_index[rows], plan.weights[rows], counts[p], p))
    return parts


@dataclass
class Dispatched:
    """What a partition's dispatch delivers to the local experts."""

    x: torch.Tensor  # (N_local, C) T_DI, grouped by expert
    counts: list[int]  # rows per local expert
    expert_ids: list[int] | None  # which experts those are (None: 0..len(counts)-1)
    weights: torch.Tensor  # (N_local,) fp32 combine weights of the local rows (the weighting runs expert-side)
    ctx: Any = None  # whatever combine / redispatch need


@dataclass
class Pending:
    """An exchange in flight (an asynchronous collective): `finish()` waits for it and returns its result."""

    finish: Callable[[], Any]


def _resolve(value):
    return value.finish() if isinstance(value, Pending) else value


class CommStage(Protocol):
    """The communication stage of a partition: tokens to the experts and back (S and R of MPMoE Fig. 4b).

    Optional members: `begin(x, parts, experts)`, called once per layer call before the first dispatch (a collective
    stage exchanges the counts of all partitions and places the experts there, once per layer call); `collective =
    True` when every rank must run the same number of partitions (the executor then never clamps n to the local
    token count); `benchmark_fn(x)`, a real exchange of x for the configurator's micro-benchmarks.
    `dispatch` and `combine` may return a `Pending` (asynchronous collectives); the executor finishes it when the
    result is needed, after computing something else.
    """

    def dispatch(self, x: torch.Tensor, plan: PartPlan) -> Dispatched:
        """Layer input x (S, C) -> the T_DI rows of the local experts, their counts, ids and weights."""

    def redispatch(self, x: torch.Tensor, plan: PartPlan, d: Dispatched) -> torch.Tensor:
        """`d.x` again, without autograd (restore strategies S2, S4)."""

    def combine(self, y_local: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Expert outputs -> rows in the order of `plan.token_index` (T_DO back to the token owner)."""


class LocalComm:
    """Single process: dispatch is an index_select, combine is the identity."""

    def dispatch(self, x: torch.Tensor, plan: PartPlan) -> Dispatched:
        return Dispatched(x.index_select(0, plan.token_index), plan.counts, None, plan.weights)

    def redispatch(self, x: torch.Tensor, plan: PartPlan, d: Dispatched) -> torch.Tensor:
        with torch.no_grad():
            return x.index_select(0, plan.token_index)

    def combine(self, y_local: torch.Tensor, ctx: Any) -> torch.Tensor:
        return y_local

    def __repr__(self) -> str:
        return "LocalComm()"


class _WeightRows(torch.autograd.Function):
    """y * w[:, None] with w in fp32 (combine weights); saves (y, w) explicitly so the saver sees T_DO."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, w)
        return y * w.to(y.dtype).unsqueeze(-1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, w = ctx.saved_tensors
        gy = g * w.to(g.dtype).unsqueeze(-1) if ctx.needs_input_grad[0] else None
        gw = (g * y).sum(-1).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gy, gw


def weight_rows(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _WeightRows.apply(y, w)


def _is_streamed(experts: nn.Module) -> bool:
    """Offloaded experts (hf_moe_offload.offload) expose `prefetch` and recompute T_M themselves."""
    return hasattr(experts, "prefetch")


def _param_storages(experts) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in experts.expert_parameters() if p.device.type != "meta"}


class PartitionedExecutor:
    """A MoE layer's executor on the model's MoE path (`MoELayer.set_pipelined`): run the layer as n token partitions
    with restore strategy S. `experts` is the layer's sorted-signature experts (resident or streamed).

    `n` / `strategy` may be fixed, or chosen per call by a `configurator` (see `configurator.PipelineConfigurator`)
    from the number of dispatched rows B. `last_stats` holds the saved-bytes accounting of the last forward.
    """

    def __init__(
        self,
        n: int = 2,
        strategy: str | RestoreStrategy = "S4",
        comm: CommStage | None = None,
        configurator=None,
        overlap: bool = True,
    ):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.strategy = restore_strategy(strategy)
        self.comm = comm or LocalComm()
        self.configurator = configurator
        self.overlap = overlap
        self.copier = HostCopier()
        self.last_stats = SavedBytes()
        self.last_choice: tuple[int, str] = (n, self.strategy.name)
        self._streams: dict[int, object] = {}  # side stream per device runtime

    def __repr__(self) -> str:
        mode = "auto" if self.configurator is not None else f"n={self.n}, strategy={self.strategy.name}"
        return f"PartitionedExecutor({mode}, comm={self.comm!r})"

    def choose(self, x: torch.Tensor, plan, experts: nn.Module) -> tuple[int, RestoreStrategy]:
        if self.configurator is None or not torch.is_grad_enabled():
            n, strategy = self.n, self.strategy
            if not torch.is_grad_enabled():
                strategy = restore_strategy("keep")  # nothing is saved for backward: nothing to restore
            return n, strategy
        n, name = self.configurator.choose(x, plan, experts, collective=getattr(self.comm, "collective", False))
        return n, restore_strategy(name)

    def __call__(self, x: torch.Tensor, plan, experts: nn.Module) -> torch.Tensor:
        """Run the layer as n partitions: 1. choose n and the strategy, 2. split the plan, 3. let the stage begin,
        4. dispatch, run and combine the partitions in MPMoE's order (`_PipelinedCall`)."""
        n, strategy = self.choose(x, plan, experts)
        if not getattr(self.comm, "collective", False):  # collective: the same n on every rank, parts may be empty
            n = max(1, min(n, x.shape[0]))
        self.last_choice = (n, strategy.name)
        parts = split_plan(plan, x.shape[0], n)
        begin = getattr(self.comm, "begin", None)
        if begin is not None:
            begin(x, parts, experts)
        stats = SavedBytes()
        self.last_stats = stats
        return _PipelinedCall(self, x, plan, experts, parts, strategy, stats).run()

    def _side_stream(self, rt):
        if id(rt) not in self._streams:
            self._streams[id(rt)] = rt.side_stream()
        return self._streams[id(rt)]


class _PartitionRun:
    """One partition's experts and weighting, and how its `PartitionSaver` re-makes them in backward (`run`,
    `recompute`, `redispatch`). It lives until backward, held by the saver: it must not hold T_DI (that would
    defeat the reuse), so `d` comes without its rows."""

    def __init__(self, executor: PartitionedExecutor, x: torch.Tensor, part: PartPlan, d: Dispatched,
                 experts: nn.Module, streamed: bool):
        self.executor = executor
        self.x = x
        self.part = part
        self.d = d
        self.experts = experts
        self.streamed = streamed

    def run(self, tdi: torch.Tensor, saver: PartitionSaver | None = None) -> torch.Tensor:
        d, experts = self.d, self.experts
        if self.streamed:  # the strategies assume the engine saves T_DI only: no kept expert graphs
            with experts.recomputing():
                y = experts(tdi, d.counts, d.expert_ids)
        else:
            y = experts(tdi, d.counts, d.expert_ids)
        if saver is not None:
            saver.phase = "tdo"
        return weight_rows(y, d.weights)

    def recompute(self, tdi: torch.Tensor) -> None:
        d = self.d
        if self.streamed:  # the engine recomputes T_M itself; only T_DO (and w) are re-made here
            with torch.no_grad():
                y = self.experts(tdi, d.counts, d.expert_ids)
            weight_rows(y.requires_grad_(True), d.weights)
        else:
            self.run(tdi)

    def redispatch(self) -> torch.Tensor:
        return self.executor.comm.redispatch(self.x, self.part, self.d)


class _PipelinedCall:
    """One call of a `PartitionedExecutor` on one layer, in MPMoE's order: dispatch of partition p+1 is issued
    before partition p's experts run, and partition p's combine overlaps partition p+1's experts (on a side stream,
    or as an asynchronous collective). Steps of each partition: `_receive`, `_prefetch`, `_dispatch` (the next one),
    `_run_experts` (under its saver), `_combine`."""

    def __init__(self, executor: PartitionedExecutor, x: torch.Tensor, plan, experts: nn.Module,
                 parts: list[PartPlan], strategy: RestoreStrategy, stats: SavedBytes):
        self.executor = executor
        self.comm = executor.comm
        self.x = x
        self.plan = plan
        self.experts = experts
        self.parts = parts
        self.strategy = strategy
        self.stats = stats
        self.streamed = _is_streamed(experts)
        self.params = _param_storages(experts)
        self.out = torch.zeros_like(x)  # T_O
        self.rt = rt = runtime_for(x.device)
        self.compute = rt.current_stream()
        # A side stream for dispatch/combine where the runtime has one (None: inline). NOTE: a collective stage on CPU
        # (gloo) overlaps through asynchronous collectives (`Pending`) instead: gloo calls from a simulated stream's
        # thread could interleave with this thread's collectives differently on each rank.
        use_side = executor.overlap and len(parts) > 1 and (x.is_cuda or not getattr(self.comm, "collective", False))
        self.side = executor._side_stream(rt) if use_side else None
        if self.side is not None:
            rt.access(x, write=True)  # produced on the compute stream; read by the side stream's dispatches
            rt.access(self.out, write=True)
        self.savers: list[PartitionSaver] = []
        self.combining: tuple[Pending, torch.Tensor] | None = None  # the previous partition's combine, in flight

    def run(self) -> torch.Tensor:
        n = len(self.parts)
        pending = self._dispatch(0)
        for p, part in enumerate(self.parts):
            d = self._receive(pending)
            self._prefetch(d)
            if p + 1 < n:
                pending = self._dispatch(p + 1)
            x_local, ctx = d.x, d.ctx
            # NOTE: what the saver keeps lives until backward; it must not hold T_DI (that would defeat the reuse).
            d = replace(d, x=None)
            y_local = self._run_experts(part, d, x_local)
            del x_local, d
            self._combine(part, y_local, ctx)
            del y_local
        self._finish_combine()
        if self.side is not None:
            self.rt.wait_stream(self.compute, self.side)
            self.rt.access(self.out)
        return self.out

    def _dispatch(self, p: int):
        """Start partition p's dispatch: inline, or (MPMoE §3.2.1) on the side stream, overlapping partition p-1's
        experts. Returns (the dispatch, maybe `Pending`; the side stream's event, or None)."""
        part = self.parts[p]
        if self.side is None:
            return self.comm.dispatch(self.x, part), None
        rt = self.rt
        rt.wait_stream(self.side, self.compute)
        res = rt.run_on(self.side, functools.partial(self._dispatch_on_side, part))
        return res, rt.record(self.side)

    def _dispatch_on_side(self, part: PartPlan) -> Dispatched:
        rt = self.rt
        rt.access(self.x)
        d = _resolve(self.comm.dispatch(self.x, part))
        for t in (d.x, d.weights):
            rt.access(t, write=True)
        return d

    def _receive(self, pending) -> Dispatched:
        """The dispatched rows of a partition, ready on the compute stream."""
        d, ready = pending
        d = _resolve(d)  # an asynchronous dispatch: issued during the previous partition's experts
        if ready is not None:
            self.rt.wait_event(ready)
            for t in (d.x, d.weights):  # made on the side stream, used here
                self.rt.record_stream(t, self.compute)
                self.rt.access(t)
        return d

    def _prefetch(self, d: Dispatched) -> None:
        if self.streamed:  # ES-MoE §4.1: the partition's first expert uploads start before its compute
            ids = d.expert_ids if d.expert_ids is not None else range(len(d.counts))
            per_expert = [0] * len(self.plan.counts)
            for e, c in zip(ids, d.counts):
                per_expert[e] += c
            self.experts.prefetch(per_expert)

    def _run_experts(self, part: PartPlan, d: Dispatched, x_local: torch.Tensor) -> torch.Tensor:
        """The partition's experts and weighting under its saver (the restore strategy and memory reuse, §3.3)."""
        job = _PartitionRun(self.executor, self.x, part, d, self.experts, self.streamed)
        saver = PartitionSaver(self.strategy, x_local, self.params, job.redispatch, job.recompute,
                               self.executor.copier, self.stats)
        if self.savers:
            prev = self.savers[-1]
            saver.on_first_unpack = prev.prefetch  # backward runs partitions in reverse: fetch p-1 while p runs
        self.savers.append(saver)
        with saver.hooks():
            y_local = job.run(x_local, saver=saver)
        saver.close()
        return y_local

    def _combine(self, part: PartPlan, y_local: torch.Tensor, ctx) -> None:
        """Send the partition's outputs home and add them into T_O (overlapping the next partition's experts)."""
        if self.side is None:
            combined = self.comm.combine(y_local, ctx)
            self._finish_combine()  # the previous partition's combine overlapped this partition's experts
            if isinstance(combined, Pending):
                self.combining = (combined, part.token_index)
            else:
                self.out.index_add_(0, part.token_index, combined.to(self.out.dtype))
        else:
            rt = self.rt
            rt.access(y_local, write=True)
            rt.wait_stream(self.side, self.compute)
            rt.record_stream(y_local, self.side)
            rt.run_on(self.side, functools.partial(self._combine_on_side, y_local, ctx, part.token_index))

    def _combine_on_side(self, y_local: torch.Tensor, ctx, token_index: torch.Tensor) -> None:
        self.rt.access(y_local)
        self.rt.access(self.out, write=True)
        self.out.index_add_(0, token_index, _resolve(self.comm.combine(y_local, ctx)).to(self.out.dtype))

    def _finish_combine(self) -> None:
        if self.combining is not None:
            combined, token_index = self.combining
            self.out.index_add_(0, token_index, combined.finish().to(self.out.dtype))
            self.combining = None


__all__ = ["CommStage", "Dispatched", "LocalComm", "PartPlan", "PartitionedExecutor", "Pending", "partition_bounds",
           "split_plan", "weight_rows"]
