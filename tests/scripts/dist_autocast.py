"""Expert parallelism under CPU autocast (issue 12), under the real launcher with gloo processes.

ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
    --dynamo_backend no tests/scripts/dist_autocast.py OUT.json --work-dir DIR

For every tier (device: static expert parallelism with resident experts; host / disk: ES-MoE dynamic placement over
the node-shared store) x MPMoE (off, S1-S4) x precision (fp32, bf16, fp16 with the GradScaler): STEPS optimizer
steps; per step the loss (averaged over ranks) and the float32 GEMMs counted in backward. Rank 0 writes the report;
the test compares each autocast run with the fp32 run of the same configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator

import hf_moe_offload  # noqa: F401
from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, MoEGPTConfig, MoEGPTForCausalLM, OffloadConfig
from hf_moe_offload.distributed import enable_expert_parallel, sync_expert_parameters
from hf_moe_offload.offload import get_offload_engine
from hf_moe_offload.pipelining import enable_micro_batch_pipelining
from hf_moe_offload.precision import GemmCounter

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--work-dir", required=True)
p.add_argument("--tiers", default="device,host,disk")
p.add_argument("--strategies", default="off,S1,S2,S3,S4")
p.add_argument("--precisions", default="fp32,bf16,fp16")
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()
logging.basicConfig(level=logging.WARNING)

accelerator = Accelerator()
rank, world = accelerator.process_index, accelerator.num_processes
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def new_model() -> MoEGPTForCausalLM:
    torch.manual_seed(0)
    cfg = MoEGPTConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=48, num_experts=6, num_experts_per_tok=2, moe_layer_frequency=1,
                       hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
                       router_aux_loss_coef=0.0, router_z_loss_coef=1e-3)
    return MoEGPTForCausalLM(cfg)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 101, (2, 12), generator=g)


def run(tier: str, strategy: str, precision: str) -> dict:
    model = new_model()
    offload = None
    if tier != "device":
        offload = OffloadConfig(mode=tier, prefetch_depth=1, host_cache_experts=4,
                                offload_dir=os.path.join(args.work_dir, f"{tier}-{strategy}-{precision}"))
    coordinator = enable_expert_parallel(model, mode="static" if tier == "device" else "dynamic",
                                         offload_config=offload)
    if strategy != "off":
        enable_micro_batch_pipelining(model, n=2, strategy=strategy)
    engine = get_offload_engine(model)
    engine = engine if engine is not None and engine.store is not None else None
    ddp_model = accelerator.prepare_model(model)
    dtype = DTYPES.get(precision)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if precision == "fp16" else None
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = inner
    if engine is not None:
        opt = ExpertAwareOptimizer(inner, ExpertOptimizer(engine, lr=1e-2, grad_scaler=scaler))
    losses, fp32_gemms = [], 0
    for step in range(args.steps):
        x = batch(step)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = ddp_model(x, labels=x).loss
        with GemmCounter() as gemms:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        fp32_gemms += gemms.by_dtype[torch.float32]
        if engine is None:
            if scaler is not None:
                scaler.step(inner)
                scaler.update()
            else:
                inner.step()
            sync_expert_parameters(model)
        else:
            opt.step()
        opt.zero_grad()
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if engine is not None:
        opt.expert_optimizer.close()
    counts = torch.tensor([fp32_gemms], dtype=torch.int64)
    dist.all_reduce(counts)
    del ddp_model
    accelerator.free_memory()
    return {"losses": losses, "fp32_gemms_in_backward": int(counts.item()), "comm": repr(coordinator.comm_stage())}


report: dict = {"world_size": world, "runs": {}}
for tier in args.tiers.split(","):
    for strategy in args.strategies.split(","):
        for precision in args.precisions.split(","):
            report["runs"][f"{tier}/{strategy}/{precision}"] = run(tier, strategy, precision)
            dist.barrier()
if rank == 0:
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
accelerator.wait_for_everyone()
accelerator.end_training()
