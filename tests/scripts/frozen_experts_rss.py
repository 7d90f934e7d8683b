"""LoRA on a checkpoint whose experts are offloaded to the host tier, frozen or not; report peak RSS and what
changed as JSON on stdout.

python tests/scripts/frozen_experts_rss.py CKPT frozen|trainable STEPS

frozen:    OffloadConfig(train_experts=False): the store holds the experts' weights only.
trainable: the same LoRA run on a store that also holds each expert's gradient and Adam moments (the experts are
           still not trained: engine.train_experts is off), i.e. what a frozen fine-tune cost before.
"""

import json
import sys

import torch
from peft import LoraConfig, get_peft_model

import hf_moe_offload  # noqa: F401
from hf_moe_offload import OffloadConfig, load_offloaded_pretrained
from hf_moe_offload.offload import get_offload_engine


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def current_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


ckpt, kind, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
torch.randn(8, 8) @ torch.randn(8, 8)  # warm up the allocator/BLAS before the baseline
baseline = current_rss()
model = load_offloaded_pretrained(ckpt, OffloadConfig(mode="host", pin_fraction=0.0,
                                                      train_experts=kind != "frozen"))
engine = get_offload_engine(model)
engine.freeze_experts()  # (already off when frozen)
experts_before = [engine.store.read_param(k).sum().item() for k in engine.store.keys()]
model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
model.train()
lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
losses = []
for _ in range(steps):
    x = torch.randint(0, model.config.vocab_size, (2, 32))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
engine.synchronize()
print(json.dumps({
    "baseline": baseline, "peak": peak_rss(), "state_rows": engine.store.state_rows,
    "store_bytes": len(engine.store) * engine.store.record_bytes(),
    "expert_weight_bytes": len(engine.store) * engine.store.numel * 4,
    "experts_unchanged": experts_before == [engine.store.read_param(k).sum().item() for k in engine.store.keys()],
    "any_expert_grad": any(engine.store.has_grad.values()),
    "lora_trained": all(not torch.equal(p.detach(), lora[n]) for n, p in model.named_parameters() if n in lora),
    "losses": losses,
}))
