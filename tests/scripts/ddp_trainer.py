"""Plain MoE-GPT (resident experts) trained with the Trainer; run alone or under accelerate launch (DDP on gloo).
`--models moe_gpt,qwen3_moe` trains each in turn into OUT/MODEL; qwen3_moe (a tiny Qwen3-MoE) with ChunkedLossTrainer
(loss 8 tokens at a time) where `--chunked`, transformers' Trainer otherwise.

python tests/scripts/ddp_trainer.py OUT --per-device-batch 4 --models moe_gpt,qwen3_moe   # one process, global batch 4
accelerate launch --multi_gpu --num_processes 2 ... ddp_trainer.py OUT --per-device-batch 2 --models ...  # same batch
"""

import argparse
import json
import os

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments, default_data_collator

import hf_moe_offload  # noqa: F401
from hf_moe_offload import ChunkedLossTrainer, MoEGPTConfig, MoEGPTForCausalLM
from hf_moe_offload.distributed import end_process_groups

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--per-device-batch", type=int, required=True)
p.add_argument("--models", default="moe_gpt", help="comma-separated from moe_gpt, qwen3_moe; each to OUT/MODEL")
p.add_argument("--chunked", action="store_true", help="ChunkedLossTrainer (qwen3_moe)")
args = p.parse_args()


def new_model(name: str):
    torch.manual_seed(0)
    if name == "moe_gpt":
        config = MoEGPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, num_experts=4, moe_layer_frequency=1, hidden_dropout=0.0,
                              attention_dropout=0.0, max_position_embeddings=32, router_aux_loss_coef=0.0)
        return MoEGPTForCausalLM(config)
    if name != "qwen3_moe":
        raise SystemExit(f"unknown model {name!r}: moe_gpt or qwen3_moe")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # No load-balancing term: it is not linear in the batch, so 2 processes would not equal 1 with it.
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=32, router_aux_loss_coef=0.0, output_router_logits=False, use_cache=False))


def train(name: str) -> None:
    out = os.path.join(args.out, name)
    model = new_model(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    targs = TrainingArguments(
        output_dir=out, max_steps=4, per_device_train_batch_size=args.per_device_batch, learning_rate=5e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        train_sampling_strategy="sequential", dataloader_num_workers=0,
    )
    if args.chunked and name == "qwen3_moe":
        trainer = ChunkedLossTrainer(model=model, args=targs, train_dataset=ds, data_collator=default_data_collator,
                                     loss_chunk_tokens=8)
        assert trainer.lm_loss_path() == "LM loss chunked, 8 tokens at a time"
    else:
        trainer = Trainer(model=model, args=targs, train_dataset=ds, data_collator=default_data_collator)
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(os.path.join(out, "final"))
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "model": name,
                       "trainer": type(trainer).__name__}, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 has saved before the next model starts


# One process trains every model in turn (imports and process group paid once), each on a fresh Trainer.
for name in args.models.split(","):
    train(name)
end_process_groups()  # each DDP wrapper went with train()'s frame, before the group (see end_process_groups)
