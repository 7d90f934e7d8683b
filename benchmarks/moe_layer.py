"""The dropless sequential MoE layer vs transformers' own MoE block and a GShard-style capacity-mask dispatch.

    python benchmarks/moe_layer.py [--quick]                 # CPU, fp32, d=256 (writes moe_layer.json)
    python benchmarks/moe_layer.py --device cuda             # GPU, bf16 weights, d=1024 (writes moe_layer_cuda.json)

For each token count S and expert count E (top-2, d=256): forward+backward time and the bytes saved for backward
(counted with saved-tensor hooks: what the layer holds between forward and backward) of
(saved bytes: distinct storages that are not the parameters' own), for
- ours: `MoEGPTSparseMoeBlock` (argsort dispatch, each matmul of the experts one grouped GEMM over their contiguous
  slices, `GroupedLinear`, a gathering combine); ours_loop: the same with the experts one after another;
- transformers' `Qwen3MoeSparseMoeBlock` with its `eager` experts and, where it runs on CPU, `grouped_mm`; and the
  same block through our experts path (`qwen3_ours`: same router, same SwiGLU tensors), so that "x qwen3_ours"
  compares the two implementations of one layer;
- GShard-style dense dispatch: a (S, E, C) combine/dispatch mask with capacity C = ceil(1.25 * k * S / E), einsum
  dispatch, batched expert matmuls over (E, C) slots, einsum combine (its mask bytes are reported separately).
Expert FFNs differ (ours and GShard: GELU with biases, 2 matmuls; Qwen3: SwiGLU, 3 matmuls), so Qwen3's expert width
is set to 2/3 of ours for equal FLOPs, and times are also reported per useful expert FLOP (assignments x FFN FLOPs
x 3 for forward+backward). The variants run interleaved, one fwd+bwd each per round; "x ours" is the median over
rounds of a variant's time / ours in the same round (the machine's drift falls on every variant alike). Writes
benchmarks/moe_layer.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hf_moe_offload.models.moe_gpt import MoEGPTConfig, MoEGPTSparseMoeBlock  # noqa: E402
from hf_moe_offload.models.moe_gpt.moe_ops import GroupedLinear  # noqa: E402

sys.path.insert(0, HERE)
from timing import interleaved_rounds, median_ratio  # noqa: E402

H, I, K = 256, 1024, 2
I_QWEN = (2 * I // 3) // 8 * 8  # equal FLOPs to 2/3; a multiple of 8 keeps grouped_mm's 16-byte stride rule


def ours(E: int) -> torch.nn.Module:
    cfg = MoEGPTConfig(vocab_size=8, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, intermediate_size=I,
                       num_experts=E, num_experts_per_tok=K)
    block = MoEGPTSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)

    def run(x):
        return block(x.unsqueeze(0))[0].squeeze(0)

    return block, run


def ours_loop(E: int):
    """Ours with the per-expert loop (experts one after another), as before the grouped GEMM."""
    block, run = ours(E)

    def looped(x):
        usable = GroupedLinear.usable
        GroupedLinear.usable = staticmethod(lambda *a: False)
        try:
            return run(x)
        finally:
            GroupedLinear.usable = usable

    return block, looped


def qwen3(E: int, impl: str):
    """transformers' Qwen3-MoE block with its experts implementation `impl` ("eager", "grouped_mm"), or with
    `impl="ours"` run through hf_moe_offload's experts path (`moe_path`: argsort dispatch, grouped GEMM, gathering
    combine; experts resident): the same router and SwiGLU tensors, so `qwen3_ours` vs `qwen3_grouped_mm` compares
    two implementations of one layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I_QWEN, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True, num_hidden_layers=1, vocab_size=8, num_attention_heads=4,
                         num_key_value_heads=4)
    if impl == "ours":
        from hf_moe_offload.families.moe_path import moe_path

        model = Qwen3MoeForCausalLM(cfg)
        moe_path(model).install()  # the path is installed on a model; the block is then timed alone
    else:
        cfg._experts_implementation = impl
        model = Qwen3MoeForCausalLM(cfg)
    block = model.model.layers[0].mlp
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)

    def run(x):
        out = block(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)

    return block, run


class GShardDispatch(torch.nn.Module):
    """Dense dispatch with a capacity mask (GShard / Switch style), GELU+bias experts as ours."""

    def __init__(self, E: int, capacity_factor: float = 1.25):
        super().__init__()
        self.E, self.cf = E, capacity_factor
        self.wg = torch.nn.Parameter(torch.randn(E, H) * 0.02)
        self.w1 = torch.nn.Parameter(torch.randn(E, H, I) * 0.02)
        self.b1 = torch.nn.Parameter(torch.zeros(E, 1, I))
        self.w2 = torch.nn.Parameter(torch.randn(E, I, H) * 0.02)
        self.b2 = torch.nn.Parameter(torch.zeros(E, 1, H))
        self.mask_bytes = 0

    def forward(self, x):  # x (S, H)
        S = x.shape[0]
        C = math.ceil(self.cf * K * S / self.E)
        probs = F.linear(x, self.wg).float().softmax(-1)
        top_w, top_e = probs.topk(K, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        combine = x.new_zeros(S, self.E, C)
        taken = torch.zeros(self.E, dtype=torch.long, device=x.device)
        for j in range(K):
            onehot = F.one_hot(top_e[:, j], self.E)
            slot = torch.cumsum(onehot, 0) - 1 + taken
            loc = (slot * onehot).sum(-1)
            keep = loc < C
            combine[torch.arange(S, device=x.device)[keep], top_e[keep, j], loc[keep]] = top_w[keep, j].to(x.dtype)
            taken = taken + onehot.sum(0)
        dispatch = combine > 0
        self.mask_bytes = combine.numel() * combine.element_size() + dispatch.numel() * dispatch.element_size()
        xe = torch.einsum("sec,sh->ech", dispatch.to(x.dtype), x)  # (E, C, H)
        h = F.gelu(torch.bmm(xe, self.w1) + self.b1)
        ye = torch.bmm(h, self.w2) + self.b2
        return torch.einsum("sec,ech->sh", combine, ye)


def gshard(E: int):
    block = GShardDispatch(E)
    return block, block


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def saved_bytes(run, block, x, g) -> int:
    """Bytes the layer holds between forward and backward (saved-tensor hooks)."""
    saved = 0
    param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = set()

    def pack(t):
        # Activations only: views of the parameters (saved for weight gradients) are not extra memory, and a
        # tensor saved twice is held once.
        nonlocal saved
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_storages and ptr not in seen:
            seen.add(ptr)
            saved += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(x)
    y.backward(g)
    return saved


def measure(variants: dict, S: int, reps: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """fwd+bwd time of every variant on the same input, interleaved round by round (`timing.interleaved_rounds`).
    Returns per variant the median time, the median over rounds of its time / ours, and its saved bytes."""
    x = torch.randn(S, H, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(S, H, device=device, dtype=dtype)
    out = {}
    for name, (block, run) in variants.items():
        run(x).backward(g)  # warm-up
        out[name] = {"saved_bytes": saved_bytes(run, block, x, g)}

    def fresh(name):  # untimed: no gradient to accumulate into, the device idle
        variants[name][0].zero_grad(set_to_none=True)
        x.grad = None
        sync()

    def fwd_bwd(run):
        def call():
            run(x).backward(g)
            sync()
        return call

    times = interleaved_rounds({name: fwd_bwd(run) for name, (_, run) in variants.items()}, reps, setup=fresh)
    for name, r in out.items():
        r["time_s"] = statistics.median(times[name])
        r["ratio_vs_ours"] = median_ratio(times[name], times["ours"])
        r["times"] = times[name]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    global H, I, I_QWEN
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 weights on a GPU, as users train there
    torch.manual_seed(0)
    if device == "cuda":
        H, I = 1024, 4096
        I_QWEN = (2 * I // 3) // 8 * 8
        token_counts = [4096] if args.quick else [4096, 16384]
        reps = 10
    else:
        torch.set_num_threads(2)
        token_counts = [1024] if args.quick else [1024, 4096]
        reps = 3 if args.quick else 9
    expert_counts = [8, 32] if args.quick else [8, 32, 64]

    def on_device(variant):
        block, run = variant
        block.to(device=device, dtype=dtype)
        return block, run

    impls = ["eager"]
    try:
        b, r = on_device(qwen3(4, "grouped_mm"))
        r(torch.randn(16, H, device=device, dtype=dtype, requires_grad=True)).sum().backward()
        impls.append("grouped_mm")
    except Exception as err:  # noqa: BLE001 - report why it is left out
        print(f"grouped_mm not measured on this machine: {type(err).__name__}: {err}")
    rows = []
    for S in token_counts:
        for E in expert_counts:
            # fwd+bwd (x3) of the expert FFNs over the S*K routed assignments: 2 matmuls of H x I (ours, GShard),
            # 3 matmuls of H x I_QWEN (Qwen3 SwiGLU); GShard's padded capacity slots do not count as useful.
            flops = {"ours": 3 * S * K * 4 * H * I, "ours_loop": 3 * S * K * 4 * H * I,
                     "gshard_mask": 3 * S * K * 4 * H * I}
            variants = {"ours": ours(E), "ours_loop": ours_loop(E), **{f"qwen3_{i}": qwen3(E, i) for i in [*impls, "ours"]},
                        "gshard_mask": gshard(E)}
            variants = {name: on_device(v) for name, v in variants.items()}
            res = measure(variants, S, reps, device, dtype)
            for name, r in res.items():
                # The same Qwen3 block, transformers' implementation over ours (> 1: ours is faster).
                same_ffn = (median_ratio(r["times"], res["qwen3_ours"]["times"])
                            if name.startswith("qwen3_") and name != "qwen3_ours" else None)
                row = {"tokens": S, "experts": E, "impl": name, "time_s": r["time_s"],
                       "time_vs_ours": r["ratio_vs_ours"], "time_vs_qwen3_ours": same_ffn,
                       "saved_MB": r["saved_bytes"] / 2**20,
                       "useful_gflops": flops.get(name, 3 * S * K * 6 * H * I_QWEN) / r["time_s"] / 1e9,
                       "mask_MB": variants[name][0].mask_bytes / 2**20 if name == "gshard_mask" else 0.0}
                rows.append(row)
    where = torch.cuda.get_device_name(0) if device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"\nMoE layer fwd+bwd, d={H}, ffn={I} (Qwen3 SwiGLU {I_QWEN}, ~equal FLOPs), top-{K}, {dtype}, {where}")
    print("x ours: time over MoE-GPT's block (ours); x qwen3_ours: time over the same Qwen3 block through ours")
    print(f"{'S':>5} {'E':>3} {'impl':>16} {'time s':>8} {'x ours':>7} {'x qwen3_ours':>12} {'useful GFLOP/s':>14} "
          f"{'saved MB':>9} {'mask MB':>8}")
    for r in rows:
        same = f"{r['time_vs_qwen3_ours']:.2f}" if r["time_vs_qwen3_ours"] is not None else "-"
        print(f"{r['tokens']:>5} {r['experts']:>3} {r['impl']:>16} {r['time_s']:>8.4f} {r['time_vs_ours']:>7.2f} "
              f"{same:>12} {r['useful_gflops']:>14.1f} {r['saved_MB']:>9.1f} {r['mask_MB']:>8.1f}")
    name = "moe_layer.json" if device == "cpu" else "moe_layer_cuda.json"
    with open(os.path.join(HERE, name), "w") as f:
        json.dump({"machine": platform.platform(), "device": where, "dtype": str(dtype),
                   "threads": torch.get_num_threads(), "rows": rows, "implementations": impls}, f, indent=2)


if __name__ == "__main__":
    main()
