"""Token exchange between ranks: the communication stage of one MoE layer.

Plain, autograd-aware functions `(tokens, split sizes, group) -> tokens`, usable by any executor (the expert-parallel
ones in `expert_parallel.py`, MPMoE's partitioned executor in `hf_moe_offload.pipelining`):

- `all_to_all`: dispatch/combine with per-rank (uneven) split sizes; backward is the transposed all-to-all
  (`all_to_all_single` works with uneven splits on gloo and NCCL; list `all_to_all` with unequal sizes does not on
  gloo).
- `copy_to_group` / `reduce_from_group`: Pipeline-MoE dispatch (PPMoE §3.3, Algorithm 1) for inputs replicated
  across a group (tensor-parallel region): identity forward + all-reduce backward, and all-reduce forward + identity
  backward (Megatron-LM's f and g).
- `all_to_all_async` / `reduce_from_group_async`: the same, started asynchronously (they return the output and a
  `wait`), so that MPMoE's partitions overlap their exchanges with expert compute.
- `scale_grad`: identity forward, scaled backward; see `expert_parallel.py` for why expert gradients from an
  all-to-all backward need 1/world.
- `ExchangePlan`: the index bookkeeping of one exchange (who sends which sorted rows where, how received rows regroup
  by expert), computed from the all-gathered (ranks x experts) token counts and a placement.

Collectives run on the tensors' device: CPU tensors on gloo, CUDA tensors on NCCL.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group,
                in_flight: list | None = None):
        ctx.splits = (output_split_sizes, input_split_sizes)
        ctx.group = group
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        send = x.contiguous()
        if in_flight is None:
            dist.all_to_all_single(out, send, output_split_sizes, input_split_sizes, group=group)
        else:  # `out` is filled when the work completes: the caller waits before reading it
            work = dist.all_to_all_single(out, send, output_split_sizes, input_split_sizes, group=group,
                                          async_op=True)
            in_flight.append((work, send))  # keep the send buffer alive until then
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_split_sizes, input_split_sizes = ctx.splits
        grad_in = grad.new_empty((sum(input_split_sizes), *grad.shape[1:]))
        # The transpose of an all-to-all is the all-to-all with the split sizes swapped.
        dist.all_to_all_single(grad_in, grad.contiguous(), input_split_sizes, output_split_sizes, group=ctx.group)
        return grad_in, None, None, None, None


def all_to_all(
    tokens: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Send rows `tokens[sum(input_split_sizes[:q]) : ...]` to rank q; receive `output_split_sizes[s]` rows from each
    rank s, concatenated in rank order. (N_in, ...) -> (N_out, ...). Differentiable (backward: the reverse exchange).

    Every rank of `group` must call it with matching sizes: `input_split_sizes[q]` on rank s equals
    `output_split_sizes[s]` on rank q.
    """
    return _AllToAll.apply(tokens, *_checked_splits(tokens, output_split_sizes, input_split_sizes), group)


def all_to_all_async(
    tokens: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, Callable[[], None]]:
    """`all_to_all` started asynchronously (MPMoE §3.2: the exchange of one partition overlaps the experts of
    another): returns (output, wait). The output's rows are valid only after `wait()`; until then nothing may read
    it. Backward is the synchronous reverse exchange."""
    in_flight: list = []
    out = _AllToAll.apply(tokens, *_checked_splits(tokens, output_split_sizes, input_split_sizes), group, in_flight)

    def wait() -> None:
        while in_flight:
            in_flight.pop()[0].wait()

    return out, wait


def _checked_splits(tokens: torch.Tensor, output_split_sizes, input_split_sizes) -> tuple[list[int], list[int]]:
    if tokens.shape[0] != sum(input_split_sizes):
        raise ValueError(f"all_to_all: tokens has {tokens.shape[0]} rows but input_split_sizes sum to "
                         f"{sum(input_split_sizes)}")
    return [int(n) for n in output_split_sizes], [int(n) for n in input_split_sizes]


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_flight: list | None = None):
        out = x.contiguous().clone()
        if in_flight is None:
            dist.all_reduce(out, group=group)
        else:  # `out` holds the sum once the work completes: the caller waits before reading it
            in_flight.append(dist.all_reduce(out, group=group, async_op=True))
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Enter a region where `x` is replicated on every rank of `group` and each rank uses a part of it (its experts'
    tokens): identity forward; backward sums the partial gradients of all ranks (Megatron-LM f, PPMoE Algorithm 1
    `copy_to_tensor_parallel_region`)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Leave the region: sum the partial outputs of all ranks (all-reduce); the result is replicated, so the
    backward is the identity (Megatron-LM g, PPMoE Algorithm 1 `reduce_from_tensor_parallel_region`)."""
    return _ReduceFromGroup.apply(x, group)


def reduce_from_group_async(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> tuple[torch.Tensor, Callable[[], None]]:
    """`reduce_from_group` started asynchronously: returns (output, wait); the output is the sum only after
    `wait()`."""
    in_flight: list = []
    out = _ReduceFromGroup.apply(x, group, in_flight)

    def wait() -> None:
        while in_flight:
            in_flight.pop().wait()

    return out, wait


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by `scale` in backward."""
    if scale == 1.0:
        return x
    return _ScaleGrad.apply(x, float(scale))


def all_gather_counts(counts: Sequence[int], group: ProcessGroup | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """(E,) local tokens per expert -> (world, E) int64 of every rank's counts (one small all-gather)."""
    local = torch.as_tensor(list(counts), dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    out = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(out, local, group=group)
    return torch.stack(out)


@dataclass
class ExchangePlan:
    """Index bookkeeping of one expert-parallel exchange, identical in shape on every rank.

    Local rows are the rank's dispatch-plan rows (sorted by expert). `send_order` lists them grouped by destination
    rank, then expert; `input_splits[q]` rows go to rank q. This rank receives `output_splits[s]` rows from rank s,
    grouped by expert; `regroup` reorders the received rows expert-major (all sources of expert e, in rank order, so
    expert e sees its tokens in the order of the concatenated batch), and `ungroup` is its inverse.
    """

    send_order: torch.Tensor  # (N_local,) indices into the local sorted rows
    input_splits: list[int]
    output_splits: list[int]
    regroup: torch.Tensor  # (N_recv,) indices into the received rows
    ungroup: torch.Tensor  # (N_recv,) inverse of regroup
    expert_ids: list[int]  # experts this rank runs, in order
    expert_counts: list[int]  # tokens of each, all sources together

    @classmethod
    def build(cls, counts: torch.Tensor, rank_of: Sequence[int], rank: int,
              device: torch.device | str = "cpu") -> "ExchangePlan":
        """counts: (world, E) tokens of every rank per expert; rank_of[e]: the rank that runs expert e."""
        C = counts.to("cpu", torch.long)  # (W, E)
        world, E = C.shape
        owner = torch.as_tensor(list(rank_of), dtype=torch.long)
        unplaced = (owner < 0) & (C.sum(0) > 0)
        if bool(unplaced.any()):
            raise ValueError(f"experts {unplaced.nonzero().flatten().tolist()} received tokens but the placement "
                             "gives them no rank")
        mine = C[rank]
        offsets = torch.cumsum(mine, 0) - mine  # start of each expert's rows among the local sorted rows
        # Send: destination-major, then expert id (stable sort of experts by destination).
        placed = (owner >= 0).nonzero().flatten()
        by_dest = placed[torch.argsort(owner[placed], stable=True)]
        send = _concat_ranges(offsets[by_dest], mine[by_dest])
        input_splits = torch.zeros(world, dtype=torch.long).index_add_(0, owner[placed], mine[placed]).tolist()
        local = (owner == rank).nonzero().flatten()  # ascending expert id
        recv = C[:, local]  # (W, n_local): rows from source s for local expert e
        output_splits = recv.sum(1).tolist()
        # Received buffer is source-major (s, e); regroup to expert-major (e, s).
        flat = recv.reshape(-1)
        block_start = (torch.cumsum(flat, 0) - flat).view_as(recv)
        regroup = _concat_ranges(block_start.t().reshape(-1), recv.t().reshape(-1))
        ungroup = torch.empty_like(regroup)
        ungroup[regroup] = torch.arange(regroup.numel(), dtype=torch.long)
        return cls(
            send_order=send.to(device),
            input_splits=input_splits,
            output_splits=output_splits,
            regroup=regroup.to(device),
            ungroup=ungroup.to(device),
            expert_ids=local.tolist(),
            expert_counts=recv.sum(0).tolist(),
        )


def _concat_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """cat([arange(s, s + n) for s, n in zip(starts, lengths)]) without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    out_starts = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - out_starts, lengths, output_size=total) + torch.arange(total)


def end_process_groups() -> None:
    """Barrier, then destroy every process group: the last call of a script run under `accelerate launch`.

    A process that exits with a live gloo group can abort (SIGABRT, "terminate called without an active exception"):
    gloo's worker threads still hold work objects whose tensors are freed while the interpreter is torn down. The
    barrier keeps a rank that finished early (e.g. while rank 0 saves) from tearing down a group still in use.
    Objects that still hold gloo work (a Trainer's DDP wrapper) must go first: drop your references to the Trainer
    and model before calling this; it collects them while the interpreter is whole. No-op without an initialised
    process group. The `Trainer` never destroys its group; `accelerator.end_training()` does, without the barrier.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


__all__ = [
    "all_to_all",
    "all_to_all_async",
    "copy_to_group",
    "reduce_from_group",
    "reduce_from_group_async",
    "scale_grad",
    "all_gather_counts",
    "ExchangePlan",
    "end_process_groups",
]
