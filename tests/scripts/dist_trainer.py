"""Trainer with expert parallelism under `accelerate launch` (issue 6).

--tiers host|disk: ES-MoE dynamic placement over a node-shared store, ExpertOptimizerCallback steps the experts.
--tiers device:   static expert parallelism with resident experts, ExpertParallelCallback (global clipping, experts
                  gathered before saving); the Trainer's AdamW steps every parameter.

Several processes (expert parallelism, node-shared host or disk store):
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no tests/scripts/dist_trainer.py OUT_DIR --global-batch 8 --tiers host,disk,device
One process on the same global batches (the reference; plain expert offload):
    python tests/scripts/dist_trainer.py OUT_DIR --global-batch 8

Each process gets global-batch / world sequences per micro-step; the Trainer's seeded sampler makes the concatenation
of the ranks' micro-batches equal the single process's. Rank 0 writes OUT_DIR/TIER/result.json and OUT_DIR/TIER/final
for each of --tiers.
"""

import argparse
import json
import os

import torch
from datasets import Dataset
from transformers import TrainingArguments, default_data_collator

import hf_moe_offload  # noqa: F401
from hf_moe_offload import (
    ExpertOptimizerCallback,
    MoEGPTConfig,
    MoEGPTForCausalLM,
    OffloadConfig,
    OffloadTrainer,
    enable_expert_offload,
    save_offloaded_pretrained,
)
from hf_moe_offload.distributed import end_process_groups

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--tiers", default="host,disk,device", help="each tier's run goes to OUT/TIER, in this one process")
p.add_argument("--max-steps", type=int, default=3)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--grad-accum", type=int, default=2)
p.add_argument("--max-grad-norm", type=float, default=1.0)
args = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))


def train(tier: str) -> None:
    out = os.path.join(args.out, tier)
    targs = TrainingArguments(
        output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.global_batch // world,
        learning_rate=3e-3, warmup_steps=1, lr_scheduler_type="cosine", weight_decay=0.01,
        gradient_accumulation_steps=args.grad_accum, max_grad_norm=args.max_grad_norm, logging_steps=1,
        save_steps=args.max_steps, save_strategy="steps", report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # the first one creates the process group under accelerate launch

    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, num_experts=5, num_experts_per_tok=2, moe_layer_frequency=1,
                          hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=32,
                          router_aux_loss_coef=0.0)
    model = MoEGPTForCausalLM(config)
    engine = None
    callbacks = []
    if tier != "device":
        offload_dir = os.path.join(out, f"experts-rank{rank}")
        engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=offload_dir, host_cache_experts=4,
                                                            prefetch_depth=1))
        callbacks.append(ExpertOptimizerCallback())
    coordinator = None
    if world > 1:
        from hf_moe_offload.distributed import ExpertParallelCallback, enable_expert_parallel

        if engine is not None:
            # Offloaded already: the per-process store becomes one node-shared store (disk: in a shared directory).
            shared = OffloadConfig(mode=tier, offload_dir=os.path.join(out, "experts-node"), host_cache_experts=4)
            coordinator = enable_expert_parallel(model, mode="dynamic", offload_config=shared)
        else:
            coordinator = enable_expert_parallel(model, mode="static")
            callbacks.append(ExpertParallelCallback())

    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 64, (8, 8), generator=g)  # a learnable pattern: the loss visibly drops in a few steps
    ids = torch.cat([base, base], dim=1)[torch.randint(0, 8, (64,), generator=g)]
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    trainer = OffloadTrainer(model=model, args=targs, train_dataset=ds, data_collator=default_data_collator,
                             callbacks=callbacks)
    trainer.train()
    adam_steps = sorted(set(engine.store.steps.values())) if engine is not None else [trainer.state.global_step]
    imbalance = coordinator.load_imbalance() if coordinator is not None else 1.0
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = {
            "world_size": world,
            "tier": tier,
            "losses": losses,
            "expert_steps": adam_steps,
            "load_imbalance_max_over_mean": imbalance,
            "checkpoint_has_expert_state": os.path.exists(
                os.path.join(out, f"checkpoint-{args.max_steps}", "expert_state.safetensors")),
        }
        if engine is not None:
            save_offloaded_pretrained(model, os.path.join(out, "final"))
        else:
            model.save_pretrained(os.path.join(out, "final"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    if world > 1:
        torch.distributed.barrier()  # rank 0 has saved before the next tier starts


# One process runs every tier (the imports and the process group are paid once); each tier on a fresh model,
# engine and Trainer.
for tier in args.tiers.split(","):
    train(tier)
end_process_groups()  # each tier's DDP wrapper went with train()'s frame, before the group (see end_process_groups)
