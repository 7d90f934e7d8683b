"""Load a checkpoint released quantized (MXFP4 or FP8) into the disk tier with frozen experts; report RSS (bytes) as
JSON on stdout.

python tests/scripts/prequantized_load_rss.py CKPT OFFLOAD_DIR CACHE_EXPERTS
"""

import json
import sys

import psutil
import torch

import hf_moe_offload  # noqa: F401
from hf_moe_offload import OffloadConfig, load_offloaded_pretrained
from hf_moe_offload.offload import get_offload_engine
from hf_moe_offload.offload.lora.stand_ins import ExpertStandIn


def peak_rss() -> int:
    # VmHWM: peak RSS of this process image. Not ru_maxrss, which on Linux keeps the forking parent's RSS across exec.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


ckpt, offload_dir, cache = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
torch.randn(8, 8) @ torch.randn(8, 8)  # warm up the allocator/BLAS before the baseline
baseline = psutil.Process().memory_info().rss
model = load_offloaded_pretrained(ckpt, OffloadConfig(mode="disk", offload_dir=offload_dir, host_cache_experts=cache,
                                                      train_experts=False, pin_fraction=0.0))
peak = peak_rss()
engine = get_offload_engine(model)
print(json.dumps({
    "baseline": baseline, "peak_after_load": peak,
    "cache_bytes": engine.store.cache_experts * engine.store.record_bytes(),
    "expert_bytes": len(engine.store) * engine.store.record_bytes(),
    "non_expert_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                            if not isinstance(p, ExpertStandIn)),
    "quantization_config": hasattr(model.config, "quantization_config"),
}))
