"""Generic MoE ops, used by every family: the dispatch plan, the dropless executor, the grouped linear and the loop
over resident experts, the chunked LM loss.

One MoE layer, from router to combine (ES-MoE §4.1 "Supporting larger batches"):

    DispatchPlan.build: stable argsort of the chosen expert ids, tokens per expert
      -> run_moe: dispatch (gather the rows in expert order)
           -> experts(x_sorted, counts): each expert on its own contiguous slice (`run_sorted_experts`: one grouped
              GEMM per matmul with `GroupedLinear` where torch provides it, else one expert after another)
           -> weighted combine: each token gathers its k rows through the inverse permutation (no atomic index_add_)

This file imports only torch: it is saved beside MoE-GPT's modeling file as the Hub model's remote code
(transformers copies the files a modeling file imports relatively), and `hf_moe_offload` imports it for every
family (hf_moe_offload.families.moe_path, the offload engine, MPMoE partitions, expert parallelism). It knows nothing of
offload: an executor calls `experts(x_sorted, counts, expert_ids)` and nothing else.

References: ES-MoE (Kim et al., ICML 2024) §4.1; fairseq `moe` branch (moe_layer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def dropout_active(experts: nn.Module) -> bool:
    """Dropout inside an experts module draws masks in training: the per-expert loop (one mask per expert) and the
    offload engine's recompute (which replays them) need to know."""
    return experts.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in experts.modules())


def full_expert_counts(counts: list[int], expert_ids: list[int] | None, num_experts: int) -> list[int] | None:
    """Rows per expert for all `num_experts` experts in expert order, or None when the rows are not in that order
    (`expert_ids` not ascending)."""
    if expert_ids is None:
        return list(counts) if len(counts) == num_experts else None
    ids = list(expert_ids)
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return None
    full = [0] * num_experts
    for e, n in zip(ids, counts):
        full[e] = n
    return full


def grouped_expert_counts(x: torch.Tensor, matrices: list[torch.Tensor], counts: list[int],
                          expert_ids: list[int] | None, experts: nn.Module,
                          num_experts: int | None = None) -> list[int] | None:
    """Rows per expert, all of them in expert order, where `experts` (an experts module, its (E, ...) weight
    `matrices`) run on these rows as one grouped GEMM per matmul (`GroupedLinear.usable`, no dropout inside the
    experts: the loop draws one mask per expert); None: one expert after another. `num_experts`: E where `matrices`
    hold a chunk of the experts (the disk tier's staging block)."""
    full = full_expert_counts(counts, expert_ids, matrices[0].shape[0] if num_experts is None else num_experts)
    if full is None or dropout_active(experts) or not GroupedLinear.usable(x, matrices, full):
        return None
    return full


def run_sorted_experts(
    x_sorted: torch.Tensor,
    counts: list[int],
    expert_ids: list[int] | None,
    tensors: list[torch.Tensor],
    matrices: list[torch.Tensor],
    experts: nn.Module,
    expert_fn: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor],
    grouped_fn: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """Resident experts on rows sorted by expert: `counts[i]` rows for expert `expert_ids[i]` (default i).

    `tensors`: the layer's (E, ...) tensors; `matrices`: those of them that are matmul weights (what the grouped GEMM
    takes). Where the grouped GEMM serves these rows (`grouped_expert_counts`) all experts run at once as
    `grouped_fn(x_sorted, rows per expert for all E)`; else one after another as `expert_fn(rows, [t[e] for t in
    tensors])`. (S, C) -> (S, C).
    """
    full = grouped_expert_counts(x_sorted, matrices, counts, expert_ids, experts)
    if full is not None:
        return grouped_fn(x_sorted, full)
    # NOTE: unbind once instead of indexing W[e] per expert: each indexing op's backward would materialise a full
    # (E, ...) gradient, O(E^2) memory traffic per layer; unbind's backward stacks the slices once.
    per_expert = [t.unbind(0) for t in tensors]
    outputs, start = [], 0
    for i, n in enumerate(counts):
        if n == 0:
            continue
        e = i if expert_ids is None else expert_ids[i]
        outputs.append(expert_fn(x_sorted[start : start + n], [w[e] for w in per_expert]))
        start += n
    return torch.cat(outputs) if outputs else x_sorted[:0].clone()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the grouped GEMM's backward refuses a broadcast
    (stride-0) one, such as the gradient of a `.sum()`."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class _ExpertBias(torch.autograd.Function):
    """`y + b[rows]` for rows sorted by expert (CUDA). The bias gradient, each expert's sum of its rows, is one GEMM of
    the 0/1 (E, N) `members` matrix with the (N, out) gradient (fp32 accumulation in cuBLAS) instead of
    index_select's backward, an `index_add_` whose atomic adds all land on E rows (benchmarks/moe_layer.py on a GPU)."""

    @staticmethod
    def forward(ctx, y, b, rows, members):
        ctx.save_for_backward(members)
        return y + b.index_select(0, rows)

    @staticmethod
    def backward(ctx, g):
        (members,) = ctx.saved_tensors
        return g, members @ g, None, None


class _SegmentBias(torch.autograd.Function):
    """`y + b[rows]` for rows sorted by expert (CPU), added in place one expert's rows at a time: `index_select`
    would first copy the bias out to an (N, out) tensor, a pass as slow as the add and a fresh allocation (on the
    2-core box 24 ms vs 1 ms for N=8192, out=1024, 64 experts). The same additions, bit for bit; the bias gradient is
    `index_select`'s own (its rows summed into E rows with `index_add_`)."""

    @staticmethod
    def forward(ctx, y, b, counts, rows):
        ctx.mark_dirty(y)
        ctx.save_for_backward(rows)
        ctx.bias_shape = b.shape
        start = 0
        for e, n in enumerate(counts):
            if n:
                y[start : start + n].add_(b[e])
            start += n
        return y

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return g, g.new_zeros(ctx.bias_shape).index_add_(0, rows, g), None, None


class GroupedLinear:
    """`linear(x, w, b, transposed=False)` for every expert of a layer in one grouped GEMM
    (`torch.nn.functional.grouped_mm`): the rows of x are sorted by expert, `counts[e]` of them for expert
    e; w is (E, out, in), or (E, in, out) when `transposed`; b is (E, out). Under autocast it computes in the autocast
    dtype, as `F.linear` would (grouped_mm itself is not autocast-aware)."""

    def __init__(self, counts: list[int], x: torch.Tensor):
        self.counts = counts
        sizes = torch.tensor(counts, dtype=torch.int64, device=x.device)
        self.offs = sizes.cumsum(0).to(torch.int32)
        # output_size: without it repeat_interleave reads the total back from the device (a CUDA sync).
        self.rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device), sizes,
                                            output_size=x.shape[0])
        self.members: torch.Tensor | None = None  # CUDA: the 0/1 (E, N) matrix of `_ExpertBias`, made once per call

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 transposed: bool = False) -> torch.Tensor:
        w = w if transposed else w.transpose(-2, -1)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w.dtype
        y = F.grouped_mm(x.to(dtype), w.to(dtype), offs=self.offs)
        if b is not None:
            y = self._add_bias(y, b.to(y.dtype))
        return _ContiguousGrad.apply(y)

    def _add_bias(self, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`y + b[rows]`: on the CPU in place, one expert's rows at a time; on CUDA (where that loop would be a kernel
        launch per expert) out of place, with the membership-matrix gradient."""
        if not y.is_cuda:
            return _SegmentBias.apply(y, b, self.counts, self.rows)
        if self.members is None or self.members.dtype != y.dtype:
            # (E, N): 1 where row r is expert e's
            experts = torch.arange(len(self.offs), device=y.device).unsqueeze(1)
            self.members = (experts == self.rows.unsqueeze(0)).to(y.dtype)
        return _ExpertBias.apply(y, b, self.rows, self.members)

    # On the CPU the grouped GEMM wins where experts have few rows each (the loop's per-expert overhead dominates) and
    # loses to one GEMM per expert where they have many (benchmarks/moe_layer.py, d=256: 1.15-1.5x faster at 64-128
    # rows per expert, 0.75-0.87x at 256-1024). It runs in inference too: on the CPU grouped_mm equals one mm per
    # expert bit for bit (tests/test_grouped_gemm.py), so KV-cached decoding gives the loop's tokens.
    CPU_MAX_ROWS_PER_EXPERT = 128
    # A decoded token's two rows (top-2) run faster one by one on the CPU (the grouped call's setup costs more than
    # it saves: 752 vs 705 us for a d=128 MoE-GPT block; from 4 rows on the grouped GEMM wins, 911 vs 1158 us).
    CPU_MIN_ROWS = 4

    @staticmethod
    def usable(x: torch.Tensor, weights: list[torch.Tensor], counts: list[int] | None = None) -> bool:
        """Whether to run these experts through torch's grouped GEMM here: on CUDA it takes bf16 on compute
        capability 8.0+; on the CPU its rows must be 16-byte multiples and the experts must have few rows each
        (`counts`, `CPU_MAX_ROWS_PER_EXPERT`), and at least `CPU_MIN_ROWS` rows in all. Otherwise the experts run
        one by one."""
        if not hasattr(F, "grouped_mm") or not x.is_contiguous() or x.shape[0] == 0:
            return False
        dtype = _compute_dtype(x)
        if x.device.type == "cuda":
            return GroupedLinear.cuda_supports(dtype, torch.cuda.get_device_capability(x.device))
        if x.device.type != "cpu" or not dtype.is_floating_point or x.shape[0] < GroupedLinear.CPU_MIN_ROWS:
            return False
        active = sum(1 for n in counts if n) if counts is not None else 0
        if active and x.shape[0] / active > GroupedLinear.CPU_MAX_ROWS_PER_EXPERT:
            return False
        size = torch.finfo(dtype).bits // 8
        dims = [x.shape[-1]] + [d for w in weights for d in w.shape[1:]]
        # Weights may be views into a larger block (the host tier's store): each expert's matrix aligned too.
        aligned = all(w.data_ptr() % 16 == 0 and w.stride(0) * w.element_size() % 16 == 0 for w in weights)
        return x.data_ptr() % 16 == 0 and aligned and all(d * size % 16 == 0 for d in dims)


    @staticmethod
    def cuda_supports(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
        """torch's CUDA grouped GEMM: bf16 on compute capability 8.0 (Ampere) and later."""
        return dtype == torch.bfloat16 and capability >= (8, 0)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # hf_moe_offload.precision.compute_dtype's twin: this file is pushed beside MoE-GPT's modeling file as the Hub
    # model's remote code, which may import only from its own folder.
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


@dataclass
class DispatchPlan:
    """Where every (token, choice) assignment goes; sorted by expert, dropped assignments removed."""

    token_index: torch.Tensor  # (N,) source token of each sorted row
    weights: torch.Tensor  # (N,) combine weight of each sorted row (fp32)
    counts: list[int]  # tokens per expert, length E
    # (S, k): the sorted row of each (token, choice), N where dropped; None: combine with index_add_.
    inverse: torch.Tensor | None = None

    @classmethod
    def build(cls, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
              gathers: bool = True) -> "DispatchPlan":
        """`gathers`: dispatch's backward and the combine gather through `inverse` instead of adding with
        `index_add_`, which on CUDA is an atomic add per row (slow in bf16, not deterministic). Measured
        (benchmarks/moe_layer.py, with `_ExpertBias`): the layer up to 1.4x faster at 16k tokens on an H200 in bf16,
        1.04-1.07x on the CPU (alternated in one process)."""
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: earlier tokens first within an expert
        # scatter_add_, not bincount: on CUDA bincount reads the largest id back first (a second sync besides tolist)
        counts = torch.zeros(num_experts + 1, dtype=flat.dtype, device=flat.device)
        counts = counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts].tolist()
        n = sum(counts)
        order = order[:n]  # dropped assignments (id == E) sort last
        inverse = None
        if gathers:
            inverse = torch.full_like(flat, n).index_copy_(0, order, torch.arange(n, device=flat.device))
            inverse = inverse.view(-1, k)
        return cls(token_index=order // k, weights=weights.reshape(-1)[order], counts=counts, inverse=inverse)


def _sum_rows(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """(S, C): for each token the sum of its k rows of `rows` (N, C), in choice order; row N (a dropped choice) is 0."""
    if rows.shape[0] < inverse.numel():
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    return rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, rows.shape[1]).sum(1)


class _Dispatch(torch.autograd.Function):
    """`x[token_index]` whose backward sums each token's k gradient rows by gathering them (`_sum_rows`), not with
    index_select's backward (`index_add_`: on CUDA an atomic add per row, slow in bf16 and not deterministic)."""

    @staticmethod
    def forward(ctx, x, token_index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, token_index)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return _sum_rows(g, inverse), None, None


class _Combine(torch.autograd.Function):
    """The transpose of `_Dispatch`: each token's sum of its rows (gathered), whose backward is `g[token_index]`."""

    @staticmethod
    def forward(ctx, y, token_index, inverse):
        ctx.save_for_backward(token_index)
        return _sum_rows(y, inverse)

    @staticmethod
    def backward(ctx, g):
        (token_index,) = ctx.saved_tensors
        return g.index_select(0, token_index), None, None


def run_moe(x: torch.Tensor, plan: DispatchPlan, experts) -> torch.Tensor:
    """Dispatch -> sequential experts -> weighted combine for flattened tokens x: (S, C). `experts(x_sorted, counts)`
    runs each expert on its contiguous rows. Experts whose weights must arrive first (offloaded ones) are asked for
    them by their layer before this call (`hf_moe_offload.families.moe_path.MoELayer.forward`), so the reads overlap the
    permutation."""
    gathers = plan.inverse is not None
    # T_DI
    x_sorted = _Dispatch.apply(x, plan.token_index, plan.inverse) if gathers else x.index_select(0, plan.token_index)
    y_sorted = experts(x_sorted, plan.counts)  # T_DO
    y_sorted = y_sorted * plan.weights.to(y_sorted.dtype).unsqueeze(-1)
    # The combine writes in the output's dtype (autocast: bf16 expert outputs into the fp32 residual stream).
    if gathers:
        return _Combine.apply(y_sorted.to(x.dtype), plan.token_index, plan.inverse)
    return torch.zeros_like(x).index_add_(0, plan.token_index, y_sorted.to(x.dtype))


class _ChunkedLMLoss(torch.autograd.Function):
    """Mean cross-entropy of `hidden @ weight.T` (fp32 log-softmax; label -100 ignored) taken `chunk` rows at a time,
    so that no (rows, vocab) logits tensor outlives its chunk.

    When a gradient is needed, each chunk's logit gradient `(softmax - onehot) / n` becomes the hidden and weight
    gradients in the same pass (one GEMM each, as in the plain head's backward): nothing is recomputed, and backward
    only scales them by the incoming gradient. Equal to `F.cross_entropy(F.linear(hidden, weight).float(), labels)`
    and its gradients up to floating-point summation order (the weight gradient is summed over chunks in fp32).
    GEMMs run in `compute_dtype` (the autocast dtype, as `F.linear` under autocast).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, compute_dtype: torch.dtype, divisor=None):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = (labels != -100).sum() if divisor is None else torch.as_tensor(divisor, device=hidden.device)
        inv_n = 1.0 / n.clamp(min=1).float()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start : start + chunk].to(compute_dtype)
                lab = labels[start : start + chunk]
                valid = lab != -100
                target = lab.clamp(min=0)
                logits = (h @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, target[:, None]).squeeze(1)
                total += torch.where(valid, lse - picked, 0.0).sum()
                if want_h or want_w:
                    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                    g[torch.arange(g.shape[0], device=g.device), target] -= 1.0
                    g.mul_((valid.float() * inv_n)[:, None])
                    g = g.to(compute_dtype)
                    if want_h:
                        grad_h[start : start + chunk] = (g @ w).to(hidden.dtype)
                    if want_w:
                        grad_w += (g.t() @ h).float()
        ctx.grads, ctx.weight_dtype = (grad_h, grad_w), weight.dtype
        return total / n  # with no divisor, NaN when every label is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        return (None if grad_h is None else grad_h * grad_out.to(grad_h.dtype),
                None if grad_w is None else (grad_w * grad_out).to(ctx.weight_dtype), None, None, None, None)


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                    divisor: torch.Tensor | int | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100)` without materialising the
    logits of all rows at once (see `_ChunkedLMLoss`). `hidden` (N, d), `weight` (V, d), `labels` (N,).
    `divisor`: the summed loss is divided by it instead of by the number of labelled rows (transformers'
    `num_items_in_batch`, counted over a whole accumulated batch)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return _ChunkedLMLoss.apply(hidden, weight, labels, chunk, compute_dtype, divisor)


__all__ = [
    "DispatchPlan",
    "GroupedLinear",
    "chunked_lm_loss",
    "dropout_active",
    "full_expert_counts",
    "grouped_expert_counts",
    "run_moe",
    "run_sorted_experts",
]
