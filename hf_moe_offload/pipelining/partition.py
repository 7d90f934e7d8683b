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
        streamed = _is_streamed(experts)
        params = _param_storages(experts)
        out = torch.zeros_like(x)  # T_O
        rt = runtime_for(x.device)
        compute = rt.current_stream()
        # A side stream for dispatch/combine on asynchronous runtimes. NOTE: a collective stage on CPU (gloo) overlaps
        # through asynchronous collectives (`Pending`) instead: gloo calls from a simulated stream's thread could
        # interleave with this thread's collectives differently on each rank.
        use_side = rt.asynchronous and self.overlap and n > 1 and (x.is_cuda or not getattr(self.comm, "collective",
                                                                                             False))
        side = self._side_stream(rt) if use_side else None
        if side is not None:
            rt.access(x, write=True)  # produced on the compute stream; read by the side stream's dispatches
            rt.access(out, write=True)
        savers: list[PartitionSaver] = []

        def prefetch(d: Dispatched) -> None:
            if streamed:  # ES-MoE §4.1: the partition's first expert uploads start before its compute
                ids = d.expert_ids if d.expert_ids is not None else range(len(d.counts))
                per_expert = [0] * len(plan.counts)
                for e, c in zip(ids, d.counts):
                    per_expert[e] += c
                experts.prefetch(per_expert)

        def dispatch(p: int):
            part = parts[p]
            if side is None:
                return self.comm.dispatch(x, part), None

            def on_side() -> Dispatched:
                rt.access(x)
                d = _resolve(self.comm.dispatch(x, part))
                for t in (d.x, d.weights):
                    rt.access(t, write=True)
                return d

            # MPMoE §3.2.1: dispatch of partition p runs on the side stream, overlapping partition p-1's experts.
            rt.wait_stream(side, compute)
            res = rt.run_on(side, on_side)
            return res, rt.record(side)

        combining: tuple[Pending, torch.Tensor] | None = None  # the previous partition's combine, in flight

        def finish_combine() -> None:
            nonlocal combining
            if combining is not None:
                combined, token_index = combining
                out.index_add_(0, token_index, combined.finish().to(out.dtype))
                combining = None

        pending = dispatch(0)
        for p, part in enumerate(parts):
            d, ready = pending
            d = _resolve(d)  # an asynchronous dispatch: issued during the previous partition's experts
            if ready is not None:
                rt.wait_event(ready)
                for t in (d.x, d.weights):  # made on the side stream, used here
                    rt.record_stream(t, compute)
                    rt.access(t)
            prefetch(d)
            if p + 1 < n:
                pending = dispatch(p + 1)
            x_local, ctx = d.x, d.ctx
            # NOTE: the closures below live until backward; they must not hold T_DI (that would defeat the reuse).
            d = replace(d, x=None)

            def run(tdi: torch.Tensor, d=d, saver=None) -> torch.Tensor:
                if streamed:  # the strategies assume the engine saves T_DI only: no kept expert graphs
                    with experts.recomputing():
                        y = experts(tdi, d.counts, d.expert_ids)
                else:
                    y = experts(tdi, d.counts, d.expert_ids)
                if saver is not None:
                    saver.phase = "tdo"
                return weight_rows(y, d.weights)

            def recompute(tdi: torch.Tensor, d=d, run=run) -> None:
                if streamed:  # the engine recomputes T_M itself; only T_DO (and w) are re-made here
                    with torch.no_grad():
                        y = experts(tdi, d.counts, d.expert_ids)
                    weight_rows(y.requires_grad_(True), d.weights)
                else:
                    run(tdi)

            def redispatch(part=part, d=d) -> torch.Tensor:
                return self.comm.redispatch(x, part, d)

            saver = PartitionSaver(strategy, x_local, params, redispatch, recompute, self.copier, stats)
            if savers:
                prev = savers[-1]
                saver.on_first_unpack = prev.prefetch  # backward runs partitions in reverse: fetch p-1 while p runs
            savers.append(saver)
            with saver.hooks():
                y_local = run(x_local, saver=saver)
            saver.close()
            del x_local, d
            if side is None:
                combined = self.comm.combine(y_local, ctx)
                finish_combine()  # the previous partition's combine overlapped this partition's experts
                if isinstance(combined, Pending):
                    combining = (combined, part.token_index)
                else:
                    out.index_add_(0, part.token_index, combined.to(out.dtype))
            else:
                def on_side(y_local=y_local, ctx=ctx, token_index=part.token_index) -> None:
                    rt.access(y_local)
                    rt.access(out, write=True)
                    out.index_add_(0, token_index, _resolve(self.comm.combine(y_local, ctx)).to(out.dtype))

                rt.access(y_local, write=True)
                rt.wait_stream(side, compute)
                rt.record_stream(y_local, side)
                rt.run_on(side, on_side)
            del y_local
        finish_combine()
        if side is not None:
            rt.wait_stream(compute, side)
            rt.access(out)
        return out

    def _side_stream(self, rt):
        if id(rt) not in self._streams:
            self._streams[id(rt)] = rt.new_stream()
        return self._streams[id(rt)]


__all__ = ["CommStage", "Dispatched", "LocalComm", "PartPlan", "PartitionedExecutor", "Pending", "partition_bounds",
           "split_plan", "weight_rows"]
