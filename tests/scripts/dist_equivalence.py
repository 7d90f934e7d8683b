"""Expert parallelism equivalence under the real launcher (issue 6). Every rank also computes the single-process
reference on the concatenated batch (once per launch: it is the same for every mode) and compares; rank 0 writes the
JSON report.

ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 3 --num_machines 1 --mixed_precision no \
    --dynamo_backend no tests/scripts/dist_equivalence.py OUT.json --work-dir DIR

Modes (one launch runs them all, each on a fresh model):
- static:       static expert parallelism, resident experts (device tier), torch AdamW on every parameter;
- dynamic-host: ES-MoE dynamic placement, node-shared host store, ExpertOptimizer + AdamW;
- dynamic-disk: the same on the disk tier (node-shared files, per-rank LRU caches);
- ppmoe:        Pipeline-MoE index-select + all-reduce; every rank feeds the whole (concatenated) batch, as the
                ranks of a tensor-parallel group do.
Per mode: (1) one micro-batch's gradients vs the reference's, before any update; (2) STEPS optimizer steps of ACCUM
micro-steps (AdamW, weight decay, lr 1e-2), then every weight vs the reference's.

A mode may carry MPMoE micro-batch pipelining on top, as `MODE@N:S` (e.g. `static@3:S4`, `ppmoe@auto:auto`): its MoE
layers then run as N token partitions exchanging through the mode's communication stage (one micro all-to-all, or
index-select + all-reduce, per partition) with restore strategy S; the report is keyed by the whole spec.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import threading

import torch
import torch.distributed as dist
from accelerate import Accelerator

import hf_moe_offload  # noqa: F401
from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, MoEGPTConfig, MoEGPTForCausalLM, OffloadConfig
from hf_moe_offload.families.moe_path import get_moe_path
from hf_moe_offload.distributed import (
    ExchangePlan,
    all_to_all,
    disable_expert_parallel,
    enable_expert_parallel,
    sync_expert_parameters,
)
from hf_moe_offload.offload import get_offload_engine
from hf_moe_offload.pipelining import disable_micro_batch_pipelining, enable_micro_batch_pipelining

NOISE_ONLY = ("k_proj.bias",)  # exactly-zero true gradient: Adam amplifies rounding noise to +-lr (see test_expert_optimizer)
LR, WD = 1e-2, 0.1

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--work-dir", required=True)
p.add_argument("--modes", default="ddp,static,dynamic-host,dynamic-disk,ppmoe")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--per-rank-batch", type=int, default=2)
p.add_argument("--family", default="moe_gpt", help="moe_gpt, or a transformers MoE model type (tests/moe_families.py)")
args = p.parse_args()
logging.basicConfig(level=logging.WARNING)

accelerator = Accelerator(gradient_accumulation_steps=args.accum)
rank, world = accelerator.process_index, accelerator.num_processes
report: dict = {"world_size": world, "backend": dist.get_backend(), "modes": {}}


def new_model():
    if args.family != "moe_gpt":  # the family's tiny model (generic shrink), 7 experts, top-2, no aux loss
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from moe_families import tiny_model

        return tiny_model(args.family, seed=0, num_experts=7, vocab_size=101, num_experts_per_tok=2,
                          output_router_logits=False)
    torch.manual_seed(0)
    # 7 experts: uneven blocks on 2 and 3 ranks; top-2; no aux loss (it is per rank under data parallelism, a
    # different loss, as in fairseq/DeepSpeed); the z-loss (a per-token mean) is kept.
    cfg = MoEGPTConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=48, num_experts=7, num_experts_per_tok=2, moe_layer_frequency=1,
                       hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
                       router_aux_loss_coef=0.0, router_z_loss_coef=1e-3)
    return MoEGPTForCausalLM(cfg)


def param_groups(model):
    named = [(n, q) for n, q in model.named_parameters()]
    decay = [q for n, q in named if "bias" not in n and "norm" not in n]
    no_decay = [q for n, q in named if "bias" in n or "norm" in n]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def global_batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    # Skewed tokens (a few frequent ids) so that routing is uneven.
    probs = torch.tensor([1.0 / (i + 1) ** 1.2 for i in range(101)])
    return torch.multinomial(probs, world * args.per_rank_batch * 12, replacement=True, generator=g).view(-1, 12)


def local_batch(mode: str, ids: torch.Tensor) -> torch.Tensor:
    if mode == "ppmoe":
        return ids  # a tensor-parallel group: identical input on every rank
    b = args.per_rank_batch
    return ids[rank * b : (rank + 1) * b]


def max_diff(a: dict, b: dict, skip=NOISE_ONLY) -> tuple[float, str]:
    worst, name = 0.0, ""
    for k in b:
        if k.endswith(skip):
            continue
        d = (a[k].float() - b[k].float()).abs().max().item()
        if d > worst:
            worst, name = d, k
    return worst, name


class Reference:
    """The single-process run on the concatenated batches, computed once per launch: it is the same for every mode
    (same seed, same batches, same AdamW), so each mode compares against the same recorded trajectory."""

    _cached: "Reference | None" = None

    @classmethod
    def get(cls) -> "Reference":
        if cls._cached is None:
            cls._cached = cls()
        return cls._cached

    def __init__(self):
        # (1) one micro-batch's gradients, before any update.
        ref = new_model()
        ids = global_batch(99, 0)
        ref(ids, labels=ids).loss.backward()
        self.grads = {n: q.grad.clone() for n, q in ref.named_parameters()}
        # (2) STEPS x ACCUM micro-steps of AdamW: the weights after every optimizer step.
        reference = new_model()
        ref_opt = torch.optim.AdamW(param_groups(reference), lr=LR)
        self.states = []
        for step in range(args.steps):
            for micro in range(args.accum):
                ids = global_batch(step, micro)
                (reference(ids, labels=ids).loss / args.accum).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            self.states.append({k: v.detach().clone() for k, v in reference.state_dict().items()})
        with torch.no_grad():  # the trained model's logits, for the check after disable_expert_parallel
            self.logits_98 = reference(global_batch(98, 0)).logits


def expert_grads(model, engine) -> dict:
    """Expert gradients in the reference's (E, ...) parameter layout."""
    out = {}
    if engine is None or engine.store is None:
        return out
    for layer in engine.layers:
        module, lay = layer.module, layer.layout
        prefix = next(n for n, m in model.named_modules() if m is module)
        for i, t in enumerate(lay.tensors):
            rows = []
            for e in range(lay.num_experts):
                g = engine.expert_grad((layer.layer, e))
                g = torch.zeros(lay.numel) if g is None else g
                rows.append(g[lay.offsets[i] : lay.offsets[i] + t.numel].view(t.shape))
            out[f"{prefix}.{t.name}"] = torch.stack(rows)
    return out


def check_exchange() -> dict:
    """all_to_all with uneven (and zero) splits, forward values and backward gradients."""
    torch.manual_seed(rank)
    splits = [(rank + q) % 3 for q in range(world)]  # rows this rank sends to q (some zero)
    x = torch.arange(sum(splits), dtype=torch.float64).unsqueeze(-1).repeat(1, 2) + 100 * rank
    x.requires_grad_(True)
    recv_splits = [(s + rank) % 3 for s in range(world)]
    y = all_to_all(x, recv_splits, splits)
    expected = []
    for s in range(world):
        start = sum((s + q) % 3 for q in range(rank))
        expected += [start + i + 100 * s for i in range(recv_splits[s])]
    ok_fwd = y[:, 0].tolist() == [float(v) for v in expected]
    (y * (rank + 1)).sum().backward()  # d/dx = rank of the destination + 1
    dest = [q for q in range(world) for _ in range(splits[q])]
    ok_bwd = x.grad[:, 0].tolist() == [float(q + 1) for q in dest]
    # ExchangePlan: every rank's received rows equal the expert-major rows of the concatenated batch.
    counts = torch.tensor([[(s * 3 + e) % 4 for e in range(5)] for s in range(world)])
    rank_of = [e % world for e in range(5)]
    xp = ExchangePlan.build(counts, rank_of, rank)
    return {"all_to_all_forward": ok_fwd, "all_to_all_backward": ok_bwd,
            "plan_counts": xp.expert_counts == [int(counts[:, e].sum()) for e in xp.expert_ids]}


def shared_mapping_inode() -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            if "hf_moe_offload-" in line:
                parts = line.split()
                return f"{parts[3]}:{parts[4]}"  # device:inode of the mapped tmpfs file
    return None


def run_mode(spec: str) -> dict:
    result: dict = {}
    mode, _, pipelining = spec.partition("@")
    tier = {"dynamic-host": "host", "dynamic-disk": "disk"}.get(mode)
    ep_mode = "dynamic" if tier else mode
    model = new_model()
    offload = None
    if tier:
        offload = OffloadConfig(mode=tier, offload_dir=os.path.join(args.work_dir, f"experts-{mode}"),
                                host_cache_experts=4, prefetch_depth=1)
    # "ddp": the baseline, plain data parallelism (every rank runs every expert, DDP averages all gradients): how
    # close any data-parallel run gets to the single-process one in fp32.
    coordinator = enable_expert_parallel(model, mode=ep_mode, offload_config=offload) if mode != "ddp" else None
    executor = None
    if pipelining:
        n, strategy = pipelining.split(":")
        executor = enable_micro_batch_pipelining(model, n="auto" if n == "auto" else int(n), strategy=strategy)
        choices = set()
    engine = get_offload_engine(model)
    engine = engine if engine is not None and engine.store is not None else None
    if engine is not None:
        inodes = [None] * world
        dist.all_gather_object(inodes, shared_mapping_inode() if tier == "host" else "disk")
        result["one_shared_copy_per_node"] = len(set(inodes)) == 1 and inodes[0] is not None
        result["experts_are_not_parameters"] = not any("experts" in n for n, _ in model.named_parameters())
        result["store_bytes"] = len(engine.store.keys()) * engine.store.record_bytes()

    # (1) gradients of one micro-batch, before any update (DDP averages the non-expert ones).
    ids = global_batch(99, 0)
    x = local_batch(mode, ids)
    ddp_model = accelerator.prepare_model(model)
    if engine is None and coordinator is not None:
        ignored = set(getattr(ddp_model, "parameters_to_ignore", set()))
        result["experts_excluded_from_ddp"] = bool(ignored) and all("experts" in n for n in ignored) and len(
            ignored) == sum(len(layer.layout.tensors) for layer in coordinator.layers)
    ddp_model(x, labels=x).loss.backward()
    dist.barrier()
    ref = Reference.get()
    ref_g = ref.grads
    grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
    if engine is None and coordinator is not None:  # resident experts: each rank has its own experts' gradients
        for layer in coordinator.layers:
            for q in layer.resident.expert_parameters():
                dist.all_reduce(q.grad, group=coordinator.group)  # disjoint slices: the sum gathers them
    grads.update(expert_grads(model, engine))
    missing = set(ref_g) - set(grads)
    result["grad_missing"] = sorted(missing)
    result["grad_max_abs_diff"], result["grad_worst"] = max_diff(grads, ref_g, skip=())
    result["grad_max_abs"] = max(g.abs().max().item() for g in ref_g.values())
    model.zero_grad(set_to_none=True)
    dist.barrier()  # everyone has read the shared gradients before anyone clears them
    if engine is not None:
        engine.zero_grad()  # each rank clears the experts it owns
        if tier == "disk":  # ... and writes them back at once: nothing left to be written while another rank reads
            result["nothing_unpublished_after_zero_grad"] = not engine.store.dirty_keys()
    dist.barrier()
    if coordinator is not None:
        coordinator.load_imbalance(reset=True)

    # (2) training: STEPS x ACCUM micro-steps, AdamW (+ the expert-wise host optimizer for offloaded experts).
    opt = accelerator.prepare_optimizer(torch.optim.AdamW(param_groups(model), lr=LR))
    expert_opt = None
    updates: collections.Counter = collections.Counter()  # (layer, expert) -> Adam steps run by this rank
    lock = threading.Lock()
    if engine is not None:
        expert_opt = ExpertOptimizer(engine, lr=LR, weight_decay=WD)
        opt = ExpertAwareOptimizer(opt, expert_opt)
        adam_many = expert_opt._adam_many

        def counted_adam_many(steps, lr, *scaling):  # every expert step goes through it (one expert, a layer's,
            with lock:                                  # step()'s)
                for key, _, _ in steps:
                    updates[key] += 1
            return adam_many(steps, lr, *scaling)

        expert_opt._adam_many = counted_adam_many
    per_step = []
    moved = 0  # experts that ran on two or more ranks within one accumulation window
    for step in range(args.steps):
        ran_on: dict = collections.defaultdict(set)
        for micro in range(args.accum):
            ids = global_batch(step, micro)
            x = local_batch(mode, ids)
            with accelerator.accumulate(ddp_model):
                accelerator.backward(ddp_model(x, labels=x).loss)
                if executor is not None:
                    choices.add(executor.last_choice)
                if coordinator is not None:
                    for layer, placement in coordinator.placements.items():
                        for e, r in enumerate(placement.rank_of):
                            if r >= 0:
                                ran_on[(layer, e)].add(r)
                opt.step()
                opt.zero_grad()
        moved += sum(len(r) > 1 for r in ran_on.values())
        if engine is None and coordinator is not None:
            sync_expert_parameters(model)
        per_step.append(max_diff(model.state_dict(), ref.states[step])[0])
    result["weight_max_abs_diff_per_step"] = per_step
    result["weight_max_abs_diff"], result["weight_worst"] = max_diff(model.state_dict(), ref.states[-1])
    result["noise_only_max_abs_diff"] = max(
        ((model.state_dict()[k] - v).abs().max().item() for k, v in ref.states[-1].items()
         if k.endswith(NOISE_ONLY)), default=0.0)
    if coordinator is not None:
        result["load_imbalance_max_over_mean"] = coordinator.load_imbalance()
    if coordinator is not None and coordinator.mode == "dynamic":
        # ES-MoE §4.3 per rank: each rank pins its hottest experts of the last window, the same table on every rank,
        # every pin on a rank that ran that expert in the last placement, and each engine keeps exactly its own.
        tables = [None] * world
        dist.all_gather_object(tables, coordinator.pins)
        result["pins_identical_on_every_rank"] = all(t == tables[0] for t in tables)
        result["pins_per_rank"] = [sum(r == q for pins in coordinator.pins.values() for r in pins.values())
                                   for q in range(world)]
        result["pins_match_last_placement"] = all(coordinator.placements[layer].rank_of[e] == r
                                                  for layer, pins in coordinator.pins.items() for e, r in pins.items())
        result["engine_keeps_own_pins"] = sorted(engine.pins.pinned) == sorted(coordinator.pinned_keys()) and all(
            coordinator.pins[layer][e] == rank for layer, e in engine.pins.pinned)
    if executor is not None:
        result["pipelining_choices"] = sorted(choices)
        everyone = [None] * world
        dist.all_gather_object(everyone, sorted(choices))
        result["pipelining_same_choice_on_every_rank"] = all(c == everyone[0] for c in everyone)
        result["pipelining_comm"] = repr(executor.comm)
        result["pipelining_saved_bytes_dropped_or_host"] = executor.last_stats.total(fate="dropped") + \
            executor.last_stats.total(fate="host")
    result["experts_moved_between_ranks_within_a_window"] = moved
    if engine is not None:
        keys = engine.store.keys()
        mine = torch.tensor([updates[k] for k in keys], dtype=torch.int64)
        total = mine.clone()
        dist.all_reduce(total)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, int(mine.sum()))
        # Exactly once per optimizer step, summed over ranks, for every expert; and who did them.
        result["adam_steps_per_expert_all_ranks"] = sorted(set(total.tolist()))
        result["adam_steps_by_rank"] = per_rank
        result["shared_step_counts"] = sorted(set(engine.store.steps.values()))
        expert_opt.close()
    if executor is not None:
        try:
            disable_expert_parallel(model)  # refused (no collective runs) while partitions use its exchange
            result["disable_expert_parallel_refused_while_pipelined"] = False
        except RuntimeError as err:
            result["disable_expert_parallel_refused_while_pipelined"] = "disable_micro_batch_pipelining" in str(err)
        disable_micro_batch_pipelining(model)
        result["after_disable_pipelining_expert_parallel_executors"] = all(
            layer.parallel is not None and layer.pipelined is None for layer in coordinator.layers)
    if mode in ("static", "dynamic-host"):
        # disable_expert_parallel: every rank holds the whole trained model again (offloaded: a private copy).
        ids = global_batch(98, 0)
        with torch.no_grad():
            expected = ref.logits_98
            disable_expert_parallel(model)
            result["after_disable_logits_max_abs_diff"] = (model(ids).logits - expected).abs().max().item()
        result["after_disable_no_executor"] = get_moe_path(model) is None or all(
            layer.parallel is None and layer.pipelined is None for layer in get_moe_path(model).layers)
    # Every rank must agree (all-reduce the worst differences).
    t = torch.tensor([result["grad_max_abs_diff"], result["weight_max_abs_diff"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    result["all_ranks_grad_max_abs_diff"], result["all_ranks_weight_max_abs_diff"] = t.tolist()
    del ddp_model
    accelerator.free_memory()
    return result


def check_errors() -> dict:
    """Clear failures, on every rank at once (no rank left waiting in a collective)."""
    out = {}
    model = new_model()
    enable_expert_parallel(model, mode="ppmoe")
    x = global_batch(7, 0)[rank : rank + 1]  # different data per rank: not a tensor-parallel region
    try:
        model(x)
        out["ppmoe_different_inputs"] = False
    except ValueError as err:
        out["ppmoe_different_inputs"] = "identical on every rank" in str(err)
    try:
        enable_expert_parallel(new_model(), mode="dynamic")
        out["dynamic_needs_offload"] = False
    except ValueError as err:
        out["dynamic_needs_offload"] = "OffloadConfig(mode='host')" in str(err)
    return out


report["exchange"] = check_exchange()
report["errors"] = check_errors()
for mode in args.modes.split(","):
    report["modes"][mode] = run_mode(mode)
    dist.barrier()
if rank == 0:
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
accelerator.wait_for_everyone()
accelerator.end_training()
