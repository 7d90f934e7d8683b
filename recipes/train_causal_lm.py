"""Causal-LM training of the ES-MoE model sizes (MoE-S / MoE-M / MoE-L, ES-MoE Table 4) on WikiText-103 (ES-MoE §5).

ES-MoE §5 settings used as defaults here: GPT-3 shapes, top-1 routing, load-balancing loss 0.01, per-device batch
of 32 sequences, mixed precision (bf16 by default here; `--precision fp16` works on GPUs, its loss scaler covering
the expert steps), experts offloaded with the tier chosen from the memory budgets (ES-MoE §4.3 adaptive offload). The
sequence length (1024) and vocabulary (GPT-2's 50,257 instead of the paper's 51,200) are ours.

Launch (each runs offline on tiny data too: add --train-file FILE.txt and small sizes, as the tests do):

    # one GPU: MoE-S with 32 experts per MoE layer, the tier chosen automatically
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/train_causal_lm.py \
        --preset moe-s --num-experts 32

    # one GPU, experts bigger than host RAM: disk tier with a 64 GiB host cache
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/train_causal_lm.py \
        --preset moe-l --num-experts 64 --offload disk --offload-dir /nvme/experts --host-cache-mb 65536

    # four GPUs: dynamic expert placement over one node-shared store (ES-MoE §4.2)
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/train_causal_lm.py \
        --preset moe-m --num-experts 64 --offload host

    # ... the same with MPMoE micro-batch pipelining: partitions of each MoE layer overlap their all-to-all with
    # expert compute and share buffers; (n, restore strategy) chosen by the configurator (MPMoE §4)
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/train_causal_lm.py \
        --preset moe-m --num-experts 64 --offload host --pipelining auto

    # two CPU processes (gloo), a tiny smoke run on the offline Wikipedia sample
    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/train_causal_lm.py \
        --preset moe-tiny --num-experts 4 --dataset offline-wikipedia --block-size 64 --short

    # plain python works too (one process)
    python recipes/train_causal_lm.py --preset moe-tiny --dataset offline-wikipedia --short

Every flag of `hf-moe-offload train` applies (see `--help`); outputs are the same: model + tokenizer, model card
(README.md), expert-load and training-curve plots, metrics.json; --push-to-hub uploads them.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from hf_moe_offload.distributed import end_process_groups
from hf_moe_offload.errors import run_reporting_errors
from hf_moe_offload.cli.train import add_arguments, run

# ES-MoE §5 (see the docstring); everything can be overridden on the command line.
ES_MOE_DEFAULTS = dict(
    preset="moe-s",
    num_experts=32,
    top_k=1,
    block_size=1024,
    dropout=0.1,
    offload="auto",
    dataset="wikitext",
    dataset_config="wikitext-103-raw-v1",
    output_dir="outputs/es-moe-lm",
    steps=20_000,
    batch_size=32,
    lr=3e-4,
    grad_accum=1,
    logging_steps=50,
    max_eval_blocks=None,
    train_tokenizer=0,  # GPT-2 BPE, as the paper's models
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, **ES_MOE_DEFAULTS)
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    p.set_defaults(precision="bf16" if bf16 else "fp32")
    return p


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.short:  # a smoke run: keep the ES-MoE flow, shrink the sequences
        args.block_size = min(args.block_size, 128)
    return run(args, job="recipes/train_causal_lm.py")


if __name__ == "__main__":
    code = run_reporting_errors(lambda: main(sys.argv[1:]), "train_causal_lm.py", "--debug" in sys.argv)
    end_process_groups()  # under accelerate launch: a live gloo group can abort the exit
    sys.exit(code)
