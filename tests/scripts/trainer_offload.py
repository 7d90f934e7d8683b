"""OffloadTrainer (saves stream the experts) + ExpertOptimizerCallback on an offloaded tiny MoE-GPT (used by tests, also under accelerate launch).

python tests/scripts/trainer_offload.py OUT_DIR --tier disk --max-steps 4 --save-steps 2 [--resume CKPT]
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
p.add_argument("--tier", default="disk")
p.add_argument("--max-steps", type=int, default=4)
p.add_argument("--save-steps", type=int, default=2)
p.add_argument("--grad-accum", type=int, default=2)
p.add_argument("--max-grad-norm", type=float, default=1.0)
p.add_argument("--resume", default=None)
args = p.parse_args()

torch.manual_seed(0)
config = MoEGPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      num_experts=4, moe_layer_frequency=1, hidden_dropout=0.0, attention_dropout=0.0,
                      max_position_embeddings=32)
model = MoEGPTForCausalLM(config)
plain_numel = sum(p.numel() for p in model.parameters())  # every weight, experts included, before offloading
rank = int(os.environ.get("RANK", "0"))
engine = enable_expert_offload(model, OffloadConfig(mode=args.tier, offload_dir=os.path.join(args.out, f"experts-{rank}"),
                                                    host_cache_experts=3, prefetch_depth=1))
g = torch.Generator().manual_seed(1)
# A learnable pattern (repeating sequences) so the loss visibly drops in a few steps.
base = torch.randint(0, 64, (8, 8), generator=g)
ids = torch.cat([base, base], dim=1)[torch.randint(0, 8, (64,), generator=g)]
ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
targs = TrainingArguments(
    output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=4, learning_rate=3e-3,
    warmup_steps=1, lr_scheduler_type="cosine", weight_decay=0.01, gradient_accumulation_steps=args.grad_accum,
    max_grad_norm=args.max_grad_norm, logging_steps=1, save_steps=args.save_steps, save_strategy="steps",
    report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
)
callback = ExpertOptimizerCallback()
trainer = OffloadTrainer(model=model, args=targs, train_dataset=ds, data_collator=default_data_collator, callbacks=[callback])
trainer.train(resume_from_checkpoint=args.resume)
if rank == 0:
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    opt_numel = sum(q.numel() for g in trainer.optimizer.param_groups for q in g["params"])
    expert_numel = sum(layer.layout.numel * layer.layout.num_experts for layer in engine.layers)
    result = {
        "losses": losses,
        # The Trainer's optimizer holds exactly the non-expert weights: the experts (all of the rest) are stepped
        # only by the host optimizer.
        "trainer_optimizer_numel": opt_numel,
        "expert_numel": expert_numel,
        "plain_model_numel": plain_numel,
        "expert_steps": sorted(set(engine.store.steps.values())),
        "logged_keys": sorted({k for h in trainer.state.log_history for k in h}),
        "telemetry_logs": [{k: v for k, v in h.items() if k.startswith(("offload/", "expert_optim/"))}
                           for h in trainer.state.log_history if "loss" in h],
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }
    save_offloaded_pretrained(model, os.path.join(args.out, "final"))
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f)
del trainer, model  # the DDP wrapper's gloo work goes before the group (see end_process_groups)
end_process_groups()
