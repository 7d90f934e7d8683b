"""Peak memory of a training step with a 151k vocabulary: the family's own LM head and loss vs the chunked loss.

    python benchmarks/lm_head_memory.py            # Qwen3-MoE, vocab 151,936, 1024 and 4096 tokens (~3 min, 2 cores)
    python benchmarks/lm_head_memory.py --quick    # vocab 32k, 256 tokens

A small Qwen3-MoE (d=128, 2 layers of 8 experts, top-2) with Qwen's 151,936-entry vocabulary, where the head is
most of the step's memory. Each variant runs in its own process (peak RSS is per process): the model and AdamW are
built, the peak-RSS mark is reset (`/proc/self/clear_refs`), then 3 training steps (forward, backward, AdamW) on
random tokens; reported: the peak RSS above the RSS before the first step, and the median step time. Variants:
- stock: `model(input_ids, labels=...).loss` (transformers' head: (tokens, vocab) logits, their fp32 softmax and
  gradient);
- chunked-C: `hf_moe_offload.chunked_causal_lm_loss(model, batch, C)` (what ChunkedLossTrainer and
  `hf-moe-offload train` use; C = 1024 is their default): one chunk's logits are C x vocab fp32 (622 MB at 1024).
Every variant runs for every token count, the order rotating; the time ratio is variant / stock of the same token
count in this invocation. Writes benchmarks/lm_head_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, statistics, sys, time
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
sys.path.insert(0, sys.argv[4])
from hf_moe_offload import chunked_causal_lm_loss

variant, tokens, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)
model = Qwen3MoeForCausalLM(cfg).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
seq = min(tokens, 1024)
batch = {"input_ids": torch.randint(0, vocab, (tokens // seq, seq))}
batch["labels"] = batch["input_ids"]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
base = rss()
times = []
for _ in range(3):
    t0 = time.perf_counter()
    if variant == "stock":
        loss = model(**batch).loss
    else:
        loss = chunked_causal_lm_loss(model, batch, int(variant.split("-")[1])).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"peak_mb": (peak - base) / 2**20, "step_s": statistics.median(times), "loss": float(loss)}))
"""


def run(variant: str, tokens: int, vocab: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(tokens), str(vocab), os.path.dirname(HERE)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    vocab, counts = (32000, [256]) if args.quick else (151936, [1024, 4096])
    rows = []
    print(f"Training step of a Qwen3-MoE (d=128) with a {vocab:,}-entry vocabulary: peak RSS above the step's start")
    print(f"{'tokens':>7} {'variant':>12} {'peak MB':>8} {'step s':>7} {'x stock time':>12} {'loss':>8}")
    variants = ["stock", "chunked-1024", "chunked-256"]
    for i, tokens in enumerate(counts):
        order = variants[i % 3:] + variants[:i % 3]
        res = {v: run(v, tokens, vocab) for v in order}
        for v in variants:
            r = res[v]
            ratio = r["step_s"] / res["stock"]["step_s"]
            rows.append(dict(tokens=tokens, variant=v, vocab=vocab, ratio_vs_stock=ratio, **r))
            print(f"{tokens:>7} {v:>12} {r['peak_mb']:>8.0f} {r['step_s']:>7.2f} {ratio:>12.2f} {r['loss']:>8.4f}")
    if not args.quick:
        with open(os.path.join(HERE, "lm_head_memory.json"), "w") as f:
            json.dump({"machine": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "command": "python benchmarks/lm_head_memory.py", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
