"""Expert parallelism as the communication stage of MPMoE's partitioned MoE layer (MPMoE §3.2.2, Fig. 5b).

`enable_micro_batch_pipelining` (hf_moe_offload.pipelining) runs a layer as n token partitions; on a model with
expert parallelism each partition's tokens travel through one of these stages instead of `LocalComm`:

- `AllToAllComm` (modes "static" and "dynamic"): one placement per layer call (from the counts of all partitions of
  all ranks, gathered in one collective), then one micro all-to-all per partition each way. The placement must not
  change between partitions: an expert runs on exactly one rank per micro-step, which is what lets its gradient be
  complete on that rank (ES-MoE §4.2; see `expert_parallel.py`).
- `PPMoEComm` (mode "ppmoe", PPMoE §3.3): the layer input is replicated; each partition index-selects the rows of this
  rank's experts and one all-reduce per partition sums the partial outputs (of the partition's rows).

These stages are the only implementation of the exchange: expert parallelism alone runs each layer as one partition
over them. Gradient scaling (expert_parallel.py's docstring): expert gradients come out as the mean over ranks (DDP's
convention for every other parameter). The weighting runs expert-side (inside the partition), so the 1/world applied
to the gradient entering the combine also reaches the combine weights; `scale_grad(.., world)` on the received tokens
and weights undoes it for everything but the expert parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..pipelining.partition import Dispatched, PartPlan, Pending
from .exchange import (
    ExchangePlan,
    all_gather_counts,
    all_to_all,
    all_to_all_async,
    copy_to_group,
    reduce_from_group,
    reduce_from_group_async,
    scale_grad,
)
from .placement import static_owner


def check_replicated(c, layer: int, x: torch.Tensor, counts: Sequence[int]) -> None:
    """mode="ppmoe": raise unless the MoE input (and its routing) is identical on every rank of the group."""
    xd = x.detach().double()
    fingerprint = torch.tensor([float(xd.sum()), float(xd.abs().sum()), *counts], dtype=torch.float64,
                               device=c.device)
    lo, hi = fingerprint.clone(), fingerprint.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=c.group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=c.group)
    if not torch.equal(lo, hi):
        raise ValueError(
            f"mode='ppmoe' needs the MoE input identical on every rank of the group (a tensor-parallel region, "
            f"PPMoE §3.3), but MoE layer {layer} got different inputs: feed every rank the same batch, or "
            "use mode='static' / 'dynamic' for data-parallel inputs"
        )


def _keep_parameters_in_graph(y: torch.Tensor, experts, ran_any: bool) -> torch.Tensor:
    """Device tier: when this rank ran none of its experts, still give their parameters a (zero) gradient, as the
    single-process model does, so AdamW steps them (weight decay, moments) in lockstep with the reference."""
    params = experts.expert_parameters()
    if ran_any or not params or not torch.is_grad_enabled():
        return y
    return y + sum(p.reshape(-1)[:1].sum() for p in params) * 0.0


def _layer_of(coordinator, experts) -> int:
    for layer in coordinator.layers:
        if layer.experts is experts:
            return layer.index
    raise ValueError(f"{type(experts).__name__} is not an experts module of this expert-parallel model")


class _ExpertParallelStage:
    """What both stages share: a collective stage (the same n on every rank), asynchronous exchanges on CPU, and the
    zero gradient of a device-tier rank that runs none of its experts in a layer call."""

    collective = True

    def __init__(self, coordinator, overlap: bool = True):
        self.coordinator = coordinator
        # CPU tensors (gloo): exchanges are started asynchronously and returned `Pending`, so that they overlap the
        # experts of a neighbouring partition; CUDA tensors: the executor runs them on its side stream instead.
        self.overlap = overlap
        self._idle_experts: nn.Module | None = None  # set by begin() when this rank runs none of its experts

    def _finish(self, waits, finish, t: torch.Tensor):
        """`finish()` once the collectives behind `waits` completed: now, or later through a `Pending`."""

        def done():
            for wait in waits:
                wait()
            return finish()

        return Pending(done) if self.overlap and not t.is_cuda else done()

    def _with_idle_expert_grads(self, y: torch.Tensor) -> torch.Tensor:
        """The call's first combine gives idle resident experts a zero gradient, as the single-process model does
        (see `_keep_parameters_in_graph`)."""
        if self._idle_experts is not None:
            y = _keep_parameters_in_graph(y, self._idle_experts, ran_any=False)
            self._idle_experts = None
        return y


class AllToAllComm(_ExpertParallelStage):
    """Static expert parallelism or ES-MoE dynamic placement, one micro all-to-all per partition."""

    def __repr__(self) -> str:
        c = self.coordinator
        return f"AllToAllComm(mode={c.mode!r}, rank={c.rank}, world_size={c.world_size})"

    def begin(self, x: torch.Tensor, parts: list[PartPlan], experts: nn.Module) -> None:
        c = self.coordinator
        n, E = len(parts), len(parts[0].counts)
        local = [count for p in parts for count in p.counts]
        counts = all_gather_counts(local, c.group, device=c.device).view(c.world_size, n, E)
        training = torch.is_grad_enabled() and experts.training
        placement = c.place(_layer_of(c, experts), counts.sum(1), training)  # one placement for all partitions
        self._plans = [ExchangePlan.build(counts[:, p], placement.rank_of, c.rank, device=x.device)
                       for p in range(n)]
        self._idle_experts = None if any(xp.expert_ids for xp in self._plans) else experts

    def _send_rows(self, x: torch.Tensor, part: PartPlan, xp: ExchangePlan) -> torch.Tensor:
        return x.index_select(0, part.token_index.index_select(0, xp.send_order))

    def dispatch(self, x: torch.Tensor, part: PartPlan) -> Dispatched | Pending:
        c = self.coordinator
        xp = self._plans[part.index]
        w = part.weights.index_select(0, xp.send_order).unsqueeze(-1)
        (x_recv, wait_x), (w_recv, wait_w) = (all_to_all_async(t, xp.output_splits, xp.input_splits, c.group)
                                              for t in (self._send_rows(x, part, xp), w))

        def finish() -> Dispatched:
            x_local = x_recv.index_select(0, xp.regroup)  # expert-major
            w_local = w_recv.index_select(0, xp.regroup)[:, 0]
            return Dispatched(scale_grad(x_local, c.ddp_world_size), xp.expert_counts, xp.expert_ids,
                              scale_grad(w_local, c.ddp_world_size), ctx=xp)

        return self._finish((wait_x, wait_w), finish, x)

    def redispatch(self, x: torch.Tensor, part: PartPlan, d: Dispatched) -> torch.Tensor:
        xp = d.ctx
        with torch.no_grad():  # backward, in the same order on every rank: synchronous
            recv = all_to_all(self._send_rows(x, part, xp), xp.output_splits, xp.input_splits, self.coordinator.group)
            return recv.index_select(0, xp.regroup)

    def combine(self, y_local: torch.Tensor, xp: ExchangePlan) -> torch.Tensor | Pending:
        c = self.coordinator
        y = scale_grad(self._with_idle_expert_grads(y_local), 1.0 / c.ddp_world_size).index_select(0, xp.ungroup)
        y_back, wait = all_to_all_async(y, xp.input_splits, xp.output_splits, c.group)
        # y_back is in send order (destination-major); put it back in the partition's row order.
        return self._finish((wait,), lambda: torch.zeros_like(y_back).index_copy(0, xp.send_order, y_back), y)

    def benchmark_fn(self, x: torch.Tensor) -> torch.Tensor:
        """An even all-to-all of x (rows split over the ranks): the configurator's communication micro-benchmark."""
        c = self.coordinator
        k = c.world_size
        send = [x.shape[0] // k + (1 if q < x.shape[0] % k else 0) for q in range(k)]  # the same on every rank
        with torch.no_grad():
            return all_to_all(x, [send[c.rank]] * k, send, c.group)


class PPMoEComm(_ExpertParallelStage):
    """Pipeline-MoE dispatch per partition: index-select this rank's experts' rows, all-reduce the partial outputs."""

    def __repr__(self) -> str:
        c = self.coordinator
        return f"PPMoEComm(rank={c.rank}, world_size={c.world_size})"

    def begin(self, x: torch.Tensor, parts: list[PartPlan], experts: nn.Module) -> None:
        c = self.coordinator
        layer = _layer_of(c, experts)
        E = len(parts[0].counts)
        counts = [sum(p.counts[e] for p in parts) for e in range(E)]
        if c.validate_replicated and layer not in c.ppmoe_validated:
            check_replicated(c, layer, x, counts)
            c.ppmoe_validated.add(layer)
        training = torch.is_grad_enabled() and experts.training
        c.place(layer, torch.as_tensor([counts]), training)  # static; recorded for update ownership
        self._local = [e for e in range(E) if static_owner(e, E, c.world_size) == c.rank]  # a contiguous block
        # One copy_to_group per layer call: its backward all-reduces the partial input gradients of all partitions.
        self._x = copy_to_group(x, c.group)
        self._idle_experts = None if any(counts[e] for e in self._local) else experts

    def _rows(self, part: PartPlan) -> tuple[int, int]:
        if not self._local:
            return 0, 0
        lo = sum(part.counts[: self._local[0]])
        return lo, lo + sum(part.counts[e] for e in self._local)

    def dispatch(self, x: torch.Tensor, part: PartPlan) -> Dispatched:
        lo, hi = self._rows(part)
        x_local = self._x.index_select(0, part.token_index[lo:hi])  # PPMoE: the index selection replaces the all-to-all
        w = copy_to_group(part.weights, self.coordinator.group)[lo:hi]
        ctx = (lo, hi, part.token_index.numel())
        return Dispatched(x_local, [part.counts[e] for e in self._local], list(self._local), w, ctx=ctx)

    def redispatch(self, x: torch.Tensor, part: PartPlan, d: Dispatched) -> torch.Tensor:
        lo, hi, _ = d.ctx
        with torch.no_grad():
            return x.index_select(0, part.token_index[lo:hi])

    def combine(self, y_local: torch.Tensor, ctx) -> torch.Tensor | Pending:
        lo, hi, rows = ctx
        y_local = self._with_idle_expert_grads(y_local)
        C = y_local.shape[-1]
        partial = torch.cat([y_local.new_zeros(lo, C), y_local, y_local.new_zeros(rows - hi, C)])
        total, wait = reduce_from_group_async(partial, self.coordinator.group)
        return self._finish((wait,), lambda: total, partial)

    def benchmark_fn(self, x: torch.Tensor) -> torch.Tensor:
        """An all-reduce of x: the configurator's communication micro-benchmark."""
        with torch.no_grad():
            return reduce_from_group(x, self.coordinator.group)


__all__ = ["AllToAllComm", "PPMoEComm"]
