"""OffloadTrainer + peft LoRA on streamed experts under `accelerate launch` (2 gloo processes): DDP leaves the experts'
stand-ins alone and averages the adapters' gradients. Writes OUT/rank<r>.json: the adapters after training, the
number of parameters DDP ignores and the wrapper's type.

accelerate launch --multi_gpu --num_processes 2 tests/scripts/lora_experts_ddp.py OUT
"""

import json
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments, default_data_collator

from hf_moe_offload import (MoEGPTConfig, MoEGPTForCausalLM, OffloadConfig, OffloadTrainer, enable_expert_offload,
                            expert_target_parameters)
from hf_moe_offload.distributed import end_process_groups

out = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
torch.manual_seed(0)
model = MoEGPTForCausalLM(MoEGPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=48, num_experts=4, moe_layer_frequency=1, hidden_dropout=0.0,
                                       attention_dropout=0.0, max_position_embeddings=32))
enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=os.path.join(out, f"experts-{rank}"),
                                           train_experts=False, host_cache_experts=3))
torch.manual_seed(1)
model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"], target_parameters=expert_target_parameters(model),
                                         init_lora_weights=False))
g = torch.Generator().manual_seed(2)
ids = torch.randint(0, 64, (16, 12), generator=g)
data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
args = TrainingArguments(os.path.join(out, "run"), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                         report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
trainer = OffloadTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
trainer.train()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"wrapper": type(trainer.model_wrapped).__name__,
               "ignored": len(getattr(trainer.model_wrapped, "parameters_to_ignore", ())),
               "adapters": {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if p.requires_grad}},
              f)
del trainer, model
end_process_groups()
