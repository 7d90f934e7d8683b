"""Load a checkpoint straight into the disk tier and train it; report RSS (bytes) as JSON on stdout.

python tests/scripts/bounded_memory.py CKPT OFFLOAD_DIR CACHE_EXPERTS STEPS
"""

import json
import sys

import psutil
import torch

import hf_moe_offload  # noqa: F401
from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, load_offloaded_pretrained
from hf_moe_offload.offload import get_offload_engine


def peak_rss() -> int:
    # VmHWM: peak RSS of this process image. Not ru_maxrss, which on Linux keeps the forking parent's RSS across exec.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


ckpt, offload_dir, cache, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
torch.randn(8, 8) @ torch.randn(8, 8)  # warm up the allocator/BLAS before the baseline
baseline = psutil.Process().memory_info().rss
model = load_offloaded_pretrained(ckpt, OffloadConfig(mode="disk", offload_dir=offload_dir, host_cache_experts=cache,
                                                      prefetch_depth=2, pin_fraction=0.25))
after_load = peak_rss()
engine = get_offload_engine(model)
model.train()
opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), ExpertOptimizer(engine, lr=1e-3))
losses = []
for _ in range(steps):
    x = torch.randint(0, model.config.vocab_size, (4, 32))
    loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
engine.synchronize()
non_expert = sum(p.numel() for p in model.parameters())
print(json.dumps({
    "baseline": baseline, "peak_after_load": after_load, "peak_after_train": peak_rss(),
    "cache_bytes": engine.store.cache_experts * engine.store.record_bytes(),
    "expert_state_bytes": len(engine.store) * engine.store.record_bytes(),
    "non_expert_state_bytes": 16 * non_expert, "losses": losses,
}))
