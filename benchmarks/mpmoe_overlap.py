"""MPMoE micro-batch pipelining over expert parallelism: step time of the MoE model for n partitions, with the
partitions' exchanges overlapped (asynchronous collectives) or in line, vs the unpartitioned layer (n=1).

Run under the launcher (2 gloo processes on a CPU machine; NCCL on GPUs):

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no benchmarks/mpmoe_overlap.py

Static expert parallelism (8 experts, 4 per rank), top-2, 2 MoE layers; forward + backward of the whole model, median
of 5 after 2 warm-ups, MAX over ranks; ratios against n=1 in the same invocation. Prints a table and writes
benchmarks/mpmoe_overlap.json (rank 0).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator

import hf_moe_offload  # noqa: F401
from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM
from hf_moe_offload.distributed import enable_expert_parallel, end_process_groups
from hf_moe_offload.pipelining import disable_micro_batch_pipelining, enable_micro_batch_pipelining

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {"GPT-S FFN (768 x 3072)": (768, 3072), "exchange-heavy (1024 x 512)": (1024, 512)}
CONFIGS = [(1, "keep", False), (2, "keep", False), (2, "keep", True), (4, "keep", False), (4, "keep", True),
           (2, "S4", True), (4, "S4", True)]


def step_time(model, ids, reps: int = 5) -> float:
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    rows = []
    for name, (hidden, ffn) in SHAPES.items():
        torch.manual_seed(0)
        cfg = MoEGPTConfig(vocab_size=512, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=8,
                           intermediate_size=ffn, num_experts=8, num_experts_per_tok=2, moe_layer_frequency=1,
                           hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=256)
        model = MoEGPTForCausalLM(cfg).train()
        enable_expert_parallel(model, mode="static")
        ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(rank))
        base = None
        for n, strategy, overlap in CONFIGS:
            if n > 1:
                enable_micro_batch_pipelining(model, n=n, strategy=strategy, overlap=overlap)
            t = step_time(model, ids)
            disable_micro_batch_pipelining(model)
            base = t if n == 1 else base
            rows.append({"shape": name, "n": n, "strategy": strategy, "overlap": overlap, "step_s": t,
                         "x_unpartitioned": t / base})
    if rank == 0:
        print(f"\nMPMoE partitions over static expert parallelism, {world} processes ({dist.get_backend()}), "
              f"{platform.processor() or 'cpu'}; 1024 tokens per rank, top-2, 8 experts, fwd+bwd of 2 MoE layers")
        print(f"{'shape':>28} {'n':>2} {'S':>5} {'overlap':>8} {'step s':>8} {'x n=1':>6}")
        for r in rows:
            print(f"{r['shape']:>28} {r['n']:>2} {r['strategy']:>5} {str(r['overlap']):>8} {r['step_s']:>8.3f} "
                  f"{r['x_unpartitioned']:>6.2f}")
        with open(os.path.join(HERE, "mpmoe_overlap.json"), "w") as f:
            json.dump({"machine": platform.platform(), "world_size": world, "backend": dist.get_backend(),
                       "threads_per_process": torch.get_num_threads(), "rows": rows}, f, indent=2)
    end_process_groups()


if __name__ == "__main__":
    main()
