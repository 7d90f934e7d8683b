"""The time model of `hf-moe-offload estimate`: what bounds a training step on a GPU, and how long it takes.

Three floors bound a step where the experts are streamed (DESIGN.md, "The floors of a training step"), and the
largest wins, since the engine overlaps them (ES-MoE §4.1: uploads behind compute, host Adam behind the backward):

- **GPU compute**: the step's FLOPs (`StepFlops`: forward, backward and every recompute) at the device's dense bf16
  rate times an efficiency (`Rates.efficiency`, stated, not measured: MoE layers run many small grouped GEMMs);
- **the link**: bytes up (routed experts in the compute dtype, or their quantized bytes) and down (trained experts'
  gradients) per micro-batch; PCIe is full duplex, so the larger direction binds;
- **host Adam**: every trained expert parameter stepped on the host once per accumulation window, at the fused
  kernel's rate measured on this host (`probe_host_adam`), or given.

The disk tier adds a fourth, its reads and writes at the disk's rate. The predicted window is the largest floor
(each micro-batch's compute and link floors times the micro-batches of a window); what it leaves out, and why it is a
floor, is in docs/estimate.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    """A GPU's dense bf16 tensor rate (vendor peak, no sparsity), its memory bandwidth and its host link's pinned copy
    rate per direction."""

    name: str
    memory_gb: float
    bf16_tflops: float
    hbm_tbps: float
    pcie_gbps: float


# Link rates: PCIe 5.0 x16 at the ~51 GB/s a pinned host-to-device copy measured on an H200 (2026-11-26,
# shared/notes/gpu-streamed-path.md); PCIe 4.0 x16 at half of it. The compute rates are the vendors' data sheets.
GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM", 80.0, 989.0, 3.35, 50.0),
    "h100-pcie": Gpu("H100 PCIe", 80.0, 756.0, 2.0, 50.0),
    "h200": Gpu("H200", 141.0, 989.0, 4.8, 50.0),
    "a100": Gpu("A100 80GB", 80.0, 312.0, 2.0, 25.0),
    "l40s": Gpu("L40S", 48.0, 362.0, 0.86, 25.0),
    "a6000": Gpu("RTX A6000", 48.0, 155.0, 0.77, 25.0),
    "rtx4090": Gpu("RTX 4090", 24.0, 165.0, 1.0, 25.0),
    "rtx3090": Gpu("RTX 3090", 24.0, 71.0, 0.94, 25.0),
    "a10": Gpu("A10", 24.0, 125.0, 0.6, 25.0),
    "l4": Gpu("L4", 24.0, 121.0, 0.3, 25.0),
}
DEFAULT_GPU = "h100"
DEFAULT_EFFICIENCY = 0.4  # of the dense peak: what a training step's mix of GEMMs, attention and launches reaches
DEFAULT_DISK_GBPS = 3.0  # a PCIe 4.0 NVMe drive's sequential reads


@dataclass(frozen=True)
class Rates:
    gpu: str
    gpu_tflops: float
    efficiency: float
    hbm_tbps: float
    pcie_gbps: float
    host_adam_gps: float  # G expert parameters per second
    host_adam_source: str  # "measured on this host" or "given"
    disk_gbps: float = DEFAULT_DISK_GBPS

    @property
    def flops_per_s(self) -> float:
        return self.gpu_tflops * 1e12 * self.efficiency


def gpu_key(device_name: str) -> str | None:
    """The table's row of a device name as torch reports it (e.g. 'NVIDIA H100 80GB HBM3' -> 'h100'); None if absent."""
    name = device_name.lower().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):  # 'h100-pcie' before 'h100'
        words = key.split("-")
        if all(w in name for w in words):
            return key
    return None


def resolve_rates(gpu: str | None = None, gpu_tflops: float | None = None, efficiency: float | None = None,
                  pcie_gbps: float | None = None, host_adam_gps: float | None = None,
                  disk_gbps: float | None = None) -> Rates:
    """The rates a prediction uses: the table's for `gpu` (default an H100), each overridden where given; the host
    Adam's measured here unless given."""
    from ..errors import UserError

    key = (gpu or DEFAULT_GPU).lower()
    if key not in GPUS:
        raise UserError(f"unknown GPU {gpu!r}: one of {', '.join(GPUS)}, or give --gpu-tflops and --pcie-gbps")
    row = GPUS[key]
    measured = host_adam_gps is None
    return Rates(gpu=row.name if gpu_tflops is None else f"{gpu_tflops:g} TFLOPS", gpu_tflops=gpu_tflops or
                 row.bf16_tflops, efficiency=efficiency or DEFAULT_EFFICIENCY, hbm_tbps=row.hbm_tbps,
                 pcie_gbps=pcie_gbps or row.pcie_gbps,
                 host_adam_gps=probe_host_adam() if measured else host_adam_gps,
                 host_adam_source="measured on this host" if measured else "given",
                 disk_gbps=disk_gbps or DEFAULT_DISK_GBPS)


def probe_host_adam(seconds: float = 1.0, numel: int = 1 << 22) -> float:
    """G parameters per second torch's fused AdamW steps on this host's CPU, with all its threads (the expert
    optimizer's kernel: fp32 master, gradient and two moments). Runs for about `seconds`."""
    p = torch.zeros(numel)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # the state's allocation is not the rate
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        opt.step()
        steps += 1
    return steps * numel / (time.perf_counter() - t0) / 1e9


@dataclass
class StepFlops:
    """FLOPs of one micro-batch (2 per multiply-add), by part: forward, backward, recompute. Counted as the matmuls
    run them, attention as the full S x S products (what torch's FlopCounterMode counts; causal kernels skip about
    half); norms, activations and the optimizer are not counted."""

    parts: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def add(self, part: str, forward: float, backward: float, recompute: float = 0.0) -> None:
        f, b, r = self.parts.get(part, (0.0, 0.0, 0.0))
        self.parts[part] = (f + forward, b + backward, r + recompute)

    @property
    def forward(self) -> float:
        return sum(f for f, _, _ in self.parts.values())

    @property
    def backward(self) -> float:
        return sum(b for _, b, _ in self.parts.values())

    @property
    def recompute(self) -> float:
        return sum(r for _, _, r in self.parts.values())

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs of a model, read from its meta-device instance (`model_shape`)."""

    layers: int
    moe_layers: int
    top_k: int
    hidden: int
    attention_width: int  # query heads x head dim: the width of the S x S products
    decoder_matmul_params: int  # non-expert matmul weights inside the decoder layers (attention, routers, dense MLPs)
    first_layer_input_params: int  # those applied to the first layer's normed input (its q/k/v)
    expert_matmul_params: int  # one expert's matrices
    lm_head_params: int


def model_shape(model, config, layout, moe_layers: int) -> Shape:
    """Every 2-D parameter outside the experts, the embeddings and the LM head is a matmul weight each token meets
    once (attention projections, routers, shared experts, dense MLPs)."""
    from ..families.moe_path import find_experts_modules

    expert_ids = {id(p) for _, m in find_experts_modules(model) for p in m.parameters()}
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    skip = expert_ids | {id(p) for p in embed.parameters()} | ({id(p) for p in head.parameters()} if head else set())
    decoder = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)
    first = _first_layer_input_params(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    k = (getattr(config, "num_experts_per_tok", None) or getattr(config, "num_experts_per_token", None)
         or getattr(config, "moe_top_k", None) or getattr(config, "top_k", None) or 2)
    return Shape(layers=config.num_hidden_layers, moe_layers=moe_layers, top_k=int(k), hidden=config.hidden_size,
                 attention_width=heads * head_dim, decoder_matmul_params=decoder, first_layer_input_params=first,
                 expert_matmul_params=sum(t.numel for t in layout.tensors if len(t.shape) >= 2),
                 lm_head_params=head.weight.numel() if head is not None else 0)


def _first_layer_input_params(model) -> int:
    """The q/k/v (or fused qkv) weights of the first decoder layer: with a frozen embedding (LoRA) nothing upstream of
    them needs a gradient, so their backward computes none."""
    for name, module in model.named_modules():
        if name.endswith(("layers.0.self_attn", "h.0.attn", "layers.0.attn")):
            return sum(p.numel() for n, p in module.named_parameters()
                       if p.dim() == 2 and any(s in n for s in ("q_proj", "k_proj", "v_proj", "qkv", "c_attn",
                                                                  "q_a_proj", "kv_a_proj")))
    return 0


def step_flops(shape: Shape, batch: int, seq_len: int, *, train_experts: bool, train_rest: bool,
               lora_dense: list[tuple[int, int]] = (), lora_expert: list[tuple[int, int]] = (), lora_r: int = 0,
               experts_recompute: bool, checkpointing: bool) -> StepFlops:
    """FLOPs of one micro-batch of `batch` x `seq_len` tokens.

    A matmul's backward costs twice its forward where its weight is trained (input and weight gradients) and once
    where it is frozen (input gradient only; the first layer's q/k/v none under LoRA, `_first_layer_input_params`).
    `experts_recompute`: the streamed experts' backward recomputes their forward (on a device, and for quantized
    experts: OffloadConfig.keep_activations). `checkpointing`: transformers' activation checkpointing recomputes each
    decoder layer's forward in the backward. `lora_dense` / `lora_expert`: (in, out) of each adapted matrix (dense:
    per token; experts: per routed token of one expert)."""
    t = batch * seq_len
    fl = StepFlops()
    rest_bwd = 2.0 if train_rest else 1.0
    linear = 2.0 * t * shape.decoder_matmul_params
    first = 2.0 * t * shape.first_layer_input_params
    fl.add("attention and dense matmuls", linear, rest_bwd * linear - (0.0 if train_rest else first),
           linear if checkpointing else 0.0)
    scores = 4.0 * batch * seq_len * seq_len * shape.attention_width * shape.layers
    fl.add("attention scores", scores, 2.0 * scores, scores if checkpointing else 0.0)
    experts = 2.0 * t * shape.top_k * shape.expert_matmul_params * shape.moe_layers
    fl.add("experts", experts, (2.0 if train_experts else 1.0) * experts,
           experts * ((1 if experts_recompute else 0) + (1 if checkpointing else 0)))
    head = 2.0 * t * shape.lm_head_params
    fl.add("LM head", head, rest_bwd * head)
    # LoRA: x A^T then (.) B^T; backward: input and both factors' gradients (2x)
    dense = sum(2.0 * t * lora_r * (i + o) for i, o in lora_dense)
    if dense:
        fl.add("LoRA", dense, 2.0 * dense, dense if checkpointing else 0.0)
    on_experts = sum(2.0 * t * shape.top_k * lora_r * (i + o) for i, o in lora_expert) * shape.moe_layers
    if on_experts:
        fl.add("LoRA on experts", on_experts, 2.0 * on_experts,
               on_experts * ((1 if experts_recompute else 0) + (1 if checkpointing else 0)))
    return fl


@dataclass
class StepTime:
    """A training window's floors (seconds) and the prediction: the largest floor."""

    flops_per_micro_batch: float
    tokens_per_micro_batch: int
    micro_batches: int
    floors: dict[str, float]
    binding: str
    window_s: float
    tokens_per_s: float
    # tokens per micro-batch at which the link's time hides behind the GPU's (None: nothing crosses the link)
    link_hidden_at_tokens: int | None
    # tokens per window at which the host Adam hides behind the GPU's compute (None: no expert stepped on the host)
    adam_hidden_at_tokens: int | None


def step_time(flops: StepFlops, tokens: int, rates: Rates, *, h2d: int, d2h: int, host_adam_params: int,
              micro_batches: int = 1, disk_bytes: int = 0) -> StepTime:
    """The floors of one window of `micro_batches` micro-batches: GPU compute and link per micro-batch times the
    micro-batches, the host Adam once, the disk tier's reads and writes per micro-batch (frozen experts) or per
    step."""
    gpu = flops.total / rates.flops_per_s
    link = max(h2d, d2h) / (rates.pcie_gbps * GB)
    adam = host_adam_params / (rates.host_adam_gps * 1e9)
    floors = {"GPU compute": micro_batches * gpu, "PCIe link": micro_batches * link, "host Adam": adam}
    if disk_bytes:
        floors["disk"] = micro_batches * disk_bytes / (rates.disk_gbps * GB)
    binding = max(floors, key=floors.get)
    window = floors[binding]
    per_token = gpu / tokens  # seconds of GPU compute per token at this sequence length
    return StepTime(
        flops_per_micro_batch=flops.total, tokens_per_micro_batch=tokens, micro_batches=micro_batches, floors=floors,
        binding=binding, window_s=window, tokens_per_s=micro_batches * tokens / window if window else math.inf,
        link_hidden_at_tokens=math.ceil(link / per_token) if link else None,
        adam_hidden_at_tokens=math.ceil(adam / per_token) if adam else None)


@dataclass
class DecodeTime:
    """Decoding one token (batch 1): the experts it routes to that the device cache misses are uploaded."""

    cache_hit: float
    upload_bytes_per_token: int
    link_s: float
    compute_s: float  # the device's floor: its memory reads of the weights, or their FLOPs
    tokens_per_s: float


def decode_time(shape: Shape, upload_bytes_per_expert: int, item: int, rates: Rates, cache_hit: float,
                uploads: bool = True) -> DecodeTime:
    """Per token at batch 1: the top-k experts of each MoE layer, each missed with probability 1 - `cache_hit` and
    uploaded (`uploads=False`: the experts are resident); on the device, the weights the token meets (experts routed,
    the rest, the LM head) read once from its memory (`item` bytes each), which bounds batch-1 decoding rather
    than its FLOPs."""
    misses = shape.moe_layers * shape.top_k * (1.0 - cache_hit) if uploads else 0.0
    nbytes = int(misses * upload_bytes_per_expert)
    link = nbytes / (rates.pcie_gbps * GB)
    active = (shape.decoder_matmul_params + shape.lm_head_params
              + shape.moe_layers * shape.top_k * shape.expert_matmul_params)
    compute = max(active * item / (rates.hbm_tbps * 1e12), 2.0 * active / rates.flops_per_s)
    return DecodeTime(cache_hit, nbytes, link, compute, 1.0 / max(link, compute))


__all__ = ["DecodeTime", "GPUS", "Gpu", "gpu_key", "Rates", "Shape", "StepFlops", "StepTime", "decode_time", "model_shape",
           "probe_host_adam", "resolve_rates", "step_flops", "step_time"]
