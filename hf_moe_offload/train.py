"""`hf-moe-offload train`: the main job. Trains a small MoE-GPT on offline English text with the Trainer."""

from __future__ import annotations

import argparse
import logging
import math

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments, default_data_collator

from .data import gpt2_tokenizer, wikipedia_sample_articles
from .models.moe_gpt import MoEGPTConfig, MoEGPTForCausalLM

logger = logging.getLogger(__name__)


def lm_blocks(tokenizer, texts, block_size: int) -> Dataset:
    """Concatenate tokenized texts (EOS between documents) and cut them into `block_size` blocks."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text).input_ids + [tokenizer.eos_token_id])
    n = len(ids) // block_size
    blocks = [ids[i * block_size : (i + 1) * block_size] for i in range(n)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    tokenizer = gpt2_tokenizer()
    articles = list(wikipedia_sample_articles())
    n_eval = max(1, len(articles) // 20)
    train_ds = lm_blocks(tokenizer, articles[n_eval:], args.block_size)
    eval_ds = lm_blocks(tokenizer, articles[:n_eval], args.block_size).select(range(args.eval_blocks))
    config = MoEGPTConfig(
        vocab_size=len(tokenizer), max_position_embeddings=args.block_size, hidden_size=args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=4, intermediate_size=4 * args.hidden_size,
        num_experts=args.num_experts, num_experts_per_tok=2, moe_layer_frequency=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    model = MoEGPTForCausalLM(config)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), logging_steps=5,
        eval_strategy="steps", eval_steps=max(1, args.steps // 2), per_device_eval_batch_size=args.batch_size,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=args.seed,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds,
                      data_collator=default_data_collator)
    trainer.train()
    metrics = trainer.evaluate()
    metrics["eval_perplexity"] = math.exp(metrics["eval_loss"])
    trainer.save_model(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    logger.info("eval perplexity %.1f; model saved to %s", metrics["eval_perplexity"], args.output_dir)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
    return metrics


def add_cli(sub) -> None:
    p = sub.add_parser("train", help="train an MoE-GPT (default: a small offline run on CPU)")
    p.add_argument("--output-dir", default="outputs/moe-gpt-small")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
