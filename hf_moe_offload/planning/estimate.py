"""`hf-moe-offload estimate`: the memory each tier needs and the bytes a training step moves, from a config alone.

The model is built on the meta device from its `config.json` (no weights read), so every family
the package serves counts its own parameters: the experts (through the same layouts the store uses), the rest, and,
for LoRA, peft's own adapters (peft builds them on the meta device too). The accounting:

- **Expert store** (ES-MoE §4.1): a trained expert keeps fp32 weights, gradient and two Adam moments (16 bytes per
  parameter); a frozen one (LoRA) its weights only, in the model's dtype or quantized (`expert_storage`: the
  bitsandbytes row of offload/stores/quantized.py). The host tier holds the store in host memory; the disk tier in files,
  with a host cache of `host_cache_experts` records (default: a quarter of the experts, as `enable_expert_offload`).
- **The rest of the model** on the compute device: full fine-tuning keeps weights, gradients and AdamW's two moments
  in the model's dtype (4 x its bytes per parameter), or with `dense_optimizer_on_host` the weights and gradients
  only (the fp32 masters and moments, 16 bytes per parameter with the gradient landed, in host memory); LoRA keeps
  the frozen weights plus peft's adapters (fp32, as peft casts them) with their gradients and moments (16 bytes per
  adapter parameter), or with `lora_in_store` the attention's only: the experts' factors and their state
  live in the store and come up with their chunk, in the compute dtype.
- **Activations** at the step's peak, part by part (hf_moe_offload/planning/activations.py): the layer inputs checkpointing
  keeps (or every layer's saved tensors), and the larger of the chunked LM loss's forward and one layer's backward
  (its recompute, a streamed chunk's recomputed forward and its gradients twice).
- **Engine buffers** where the experts compute: on a GPU the slab's two blocks (a whole layer's experts within a
  quarter of the memory free when the engine binds, or `device_budget_bytes`: offload/plan.py), the stager's slots,
  and the trained experts pinned there with their state within what the slab leaves; on the CPU the disk tier's
  staging block.
- **Bytes per step**, assuming every expert gets tokens (true of large batches): a device uploads every expert for the
  forward and again for the backward but the two chunks the slab still holds (quantized experts: their bytes); the
  disk tier reads each uncached expert once
  per sweep (frozen: forward and backward, weights only; trained: ES-MoE's minimum, `benchmarks/offload.py`, plus
  what the engine's schedule-following cache turns over between the sweeps, `estimate_stream.trained_disk_traffic`).

Process overhead (the Python interpreter, torch and transformers: ~0.5 GB of RSS) is not counted: the host figures
are what the run adds. They are what the process holds; its RSS reaches them where malloc returns freed blocks
(`host_allocator.return_freed_memory`, the jobs' `--malloc return`): glibc's defaults keep a step's freed transients
in the heap, and at Qwen3-30B-A3B's shape the peak grew 25% past the figure over three steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

import torch

from .activations import LOSS_CHUNK_TOKENS, ActivationShape, Adapters, activation_parts
from ..errors import UserError
from .estimate_stream import Stream, trained_disk_traffic
from ..offload.api import default_cache_experts, weights_only_row_dtype
from ..offload.planner import ADAM_BYTES_PER_PARAM, HEADROOM, MemoryEstimate, choose_tier, detect_budgets
from ..offload.plan import STAGE_MAX, clamp_depth, dense_on_host
from ..offload.stores.quantized import EXPERT_STORAGES, QUANTIZED_STORAGES, store_quantization
from ..offload.streaming.slab import slab_nbytes
from ..offload.stores.store import ROW_GAP_BYTES
from ..runtime import aligned_nbytes
from .time_model import DecodeTime, Rates, StepFlops, StepTime, decode_time, model_shape, step_flops, step_time

METHODS = ("full", "lora", "lora-experts")
# What `--method lora` adapts (the jobs' attention targets: the names each family gives its attention and MLP
# projections); `lora-experts` adds every expert tensor (offload/lora/expert_lora.py: expert_target_parameters).
LORA_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "fc1", "fc2"]
GiB = 2**30


@dataclass
class Workload:
    """What the run will do."""

    method: str = "full"  # full | lora (attention adapters, experts frozen) | lora-experts (adapters on them too)
    expert_storage: str = "auto"
    dtype: torch.dtype = torch.bfloat16  # the model's
    batch_size: int = 1
    seq_len: int = 512
    lora_r: int = 8
    host_cache_experts: int | None = None  # disk tier; None: a quarter of the experts (enable_expert_offload's)
    prefetch_depth: int = 2
    pin_fraction: float = 0.25  # OffloadConfig's: experts per layer kept resident (ES-MoE §4.3)
    device_budget_bytes: int | None = None  # OffloadConfig's: the slab's and pins' room (None: a quarter of the free)
    device: str = "cuda"  # where the model computes: cuda (experts uploaded) or cpu
    gradient_checkpointing: bool = False  # transformers' activation checkpointing of the decoder layers
    micro_batches: int = 1  # per accumulation window (the host Adam steps once per window)
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS  # the chunked LM loss's chunk (0: the stock loss, full logits)
    # lora-experts: the experts' LoRA factors and their Adam state live with the experts in the store, uploaded with
    # their chunk in the compute dtype and stepped by the expert optimizer (else peft's, on the device)
    lora_in_store: bool = False
    # full: the non-expert weights' fp32 masters and Adam moments on the host, stepped there; the device holds their
    # weights and gradients in the model's dtype. None: the engine's rule (offload/plan.py `dense_on_host`) at the
    # device budget
    dense_optimizer_on_host: bool | None = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise UserError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.expert_storage not in EXPERT_STORAGES:
            raise UserError(f"expert storage must be one of {', '.join(EXPERT_STORAGES)}; got {self.expert_storage!r}")
        if self.expert_storage in QUANTIZED_STORAGES and self.method == "full":
            raise UserError(f"--expert-storage {self.expert_storage} keeps frozen experts: use a LoRA method")
        if self.batch_size < 1 or self.seq_len < 1 or self.micro_batches < 1:
            raise UserError("batch size, sequence length and micro-batches must be at least 1")
        if self.loss_chunk_tokens < 0:
            raise UserError(f"loss chunk tokens must be >= 0 (0: the stock loss); got {self.loss_chunk_tokens}")
        if self.lora_in_store and self.method != "lora-experts":
            raise UserError("expert LoRA factors in the store need adapters on the experts: --method lora-experts")
        if self.dense_optimizer_on_host and self.method != "full":
            raise UserError("the dense optimizer on the host applies to a full fine-tune (--method full); LoRA "
                            "trains adapters only")

    @property
    def frozen_experts(self) -> bool:
        return self.method != "full"


@dataclass
class TierNeeds:
    """One tier's memory (bytes) and its traffic per training step (bytes)."""

    tier: str
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    h2d_bytes_per_step: int = 0
    d2h_bytes_per_step: int = 0
    disk_read_bytes_per_step: int = 0
    disk_write_bytes_per_step: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # what the figures are made of
    activations: dict[str, int] = field(default_factory=dict)  # what the "activations" part is made of
    chunk_gradient_bytes: int = 0  # one chunk of streamed experts' gradients on the device, in the backward
    chunk_share: float = 0.0  # the share of a layer's experts whose forward one chunk's backward recomputes
    device_parts: list[str] = field(default_factory=list)  # the parts on the GPU
    # the largest batch (sequences of seq_len) whose device figure fits the budget: without / with checkpointing
    largest_batch: dict[str, int] = field(default_factory=dict)
    time: StepTime | None = None  # on a GPU, where rates are given


@dataclass
class Estimate:
    model_type: str
    expert_params: int
    non_expert_params: int
    lora_params: int
    num_experts: int  # over all MoE layers
    moe_layers: int
    params_per_expert: int
    expert_record_bytes: int  # one expert in the store
    host_cache_experts: int
    tiers: dict[str, TierNeeds]
    auto: str
    auto_reason: str
    workload: Workload
    flops: StepFlops | None = None  # one micro-batch's, as the offloaded tiers run it
    device_pins: int = 0  # trained experts whose state stays on the GPU (ES-MoE §4.3), in the estimate's budget
    rates: Rates | None = None
    decode: list[DecodeTime] = field(default_factory=list)
    device_budget: int = 0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["workload"]["dtype"] = str(self.workload.dtype).removeprefix("torch.")
        if self.flops is not None:
            out["flops"] = {"forward": self.flops.forward, "backward": self.flops.backward,
                            "recompute": self.flops.recompute, "total": self.flops.total, "parts": self.flops.parts}
        return out


def meta_model(config):
    """The model of `config` on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    # every tensor is made on the meta device, not made on the host and moved there: a real-size model's 3-D expert
    # tensors (DeepSeek-V3: 30 GB per layer in fp32) are never allocated
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def estimate(config, workload: Workload, device_budget: int | None = None, host_budget: int | None = None,
             rates: Rates | None = None) -> Estimate:
    """Every tier's needs for `workload` on the model of `config`, and the tier `mode="auto"` picks within the
    budgets (default: this machine's free memory; the device's is the host's where it computes on the CPU). With
    `rates` (a GPU's, `time_model.resolve_rates`) and a workload on cuda, each tier's predicted step time too."""
    from ..families.moe_path import experts_layers

    w = workload
    model = meta_model(config)
    found = experts_layers(model)
    if not found:
        raise UserError(f"{type(model).__name__} has no experts module that hf_moe_offload serves")
    layouts = [layout for _, _, layout in found]
    p = layouts[0].numel
    n_experts = sum(lay.num_experts for lay in layouts)
    layers = len(layouts)
    layer_experts = layouts[0].num_experts
    expert_params = n_experts * p
    non_expert = sum(t.numel() for t in model.parameters()) - expert_params
    # the engine's rule where left to it (auto): at the device budget, as OffloadTrainer decides at bind
    dense_host_on = not w.frozen_experts and dense_on_host(w.dense_optimizer_on_host, non_expert, w.dtype,
                                                            device_budget, w.device == "cuda")
    shape = model_shape(model, config, layouts[0], layers)  # (before peft wraps the model below)
    act_shape = ActivationShape.of(config, model, layers, n_experts)
    lora, lora_on_experts, lora_dense, lora_expert = _lora_params(model, w) if w.frozen_experts else (0, 0, [], [])
    item = w.dtype.itemsize
    quantization = (store_quantization(w.expert_storage, w.dtype, [t.shape for t in layouts[0].tensors])
                    if w.frozen_experts else None)
    cuda = w.device == "cuda"
    host_budget = host_budget or detect_budgets(torch.device("cpu"))[1]
    device_budget = device_budget or (host_budget if not cuda else _cuda_free())

    # One expert in the store (api._build_store's rules)
    if not w.frozen_experts:
        record = ADAM_BYTES_PER_PARAM * p
    elif quantization is not None:
        record = quantization.nbytes
    else:
        record = p * weights_only_row_dtype(w.dtype).itemsize
    # Streamed copies in the compute dtype next to fp32 records (a bf16 model's trained experts on a device)
    copy = p * item if not w.frozen_experts and w.dtype != torch.float32 else 0
    store = n_experts * (record + copy)
    # the host tier's layer blocks leave ROW_GAP_BYTES after each row (offload/stores/store.py: cache-set spacing)
    host_store = store + layers * (4 if not w.frozen_experts else 1) * ROW_GAP_BYTES
    cache = w.host_cache_experts or default_cache_experts(n_experts, w.prefetch_depth)
    cache = min(cache, n_experts)

    # The rest of the model: frozen weights + trained state
    store_factors = lora_on_experts if w.lora_in_store else 0
    factors = lora_on_experts // n_experts if w.lora_in_store else 0  # one expert's LoRA parameters
    rest = {"non-expert weights": non_expert * item}
    if dense_host_on:
        rest["non-expert gradients"] = non_expert * item
        dense_host = {"dense optimizer (fp32 masters, gradients, Adam moments)": non_expert * ADAM_BYTES_PER_PARAM}
    else:
        dense_host = {}
        if not w.frozen_experts:
            rest["non-expert gradients and Adam moments"] = 3 * non_expert * item
    # peft's adapters on the device: fp32 weights, gradients and Adam moments; with the factors in the store, the
    # attention's only
    resident_lora = {"LoRA adapters (fp32 state)": lora * ADAM_BYTES_PER_PARAM} if lora else {}
    lora_rest = {"LoRA adapters (fp32 state)": (lora - store_factors) * ADAM_BYTES_PER_PARAM} if lora else {}
    # LoRA on streamed experts held by peft: each forward takes the adapters' factors once, in the model's dtype, as
    # inputs of the experts' pass (offload/lora/expert_lora.py: LoraTerm.of), kept until the next forward
    lora_factors = (lora_on_experts - store_factors) * item
    keeps_graphs = not cuda and quantization is None  # OffloadConfig.keep_activations' default
    head = not w.frozen_experts  # the LM head is trained (its fp32 gradient is formed in the chunked loss)
    tokens = w.batch_size * w.seq_len
    # the trained parameters' gradients, counted all step in the rest of the model: the loss's forward has their room
    gradient_bytes = non_expert * item if not w.frozen_experts else 0
    # the input embedding's gradient is formed after every layer's backward (untied from the head)
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    late = embedding.numel() * item if gradient_bytes and not tied else 0
    adapters = Adapters(tuple(lora_dense[: len(lora_dense) // config.num_hidden_layers]), tuple(lora_expert),
                        w.lora_r)
    # (the device tier's experts are resident: their forward graphs are kept)
    act_parts = activation_parts(act_shape, tokens, item, w.gradient_checkpointing, True,
                                 w.loss_chunk_tokens, head, gradient_bytes=gradient_bytes, adapters=adapters,
                                 late_gradient_bytes=late)
    acts = sum(act_parts.values())
    upload = quantization.nbytes if quantization is not None else p * item  # one expert's upload
    staging = STAGE_MAX * p * item if not cuda else 0  # the disk tier's staging block on the CPU
    # Present when the first forward binds the engine (the quarter of the free memory the slab and pins take is of
    # what these leave): the weights and peft's adapters; gradients and moments come with the backward and the step
    at_bind = non_expert * item + (lora - store_factors) * 4

    resident_experts = expert_params * (4 * item if not w.frozen_experts else item)
    tiers: dict[str, TierNeeds] = {}
    tiers["device"] = _place(TierNeeds("device", 0, 0, 0, activations=act_parts, parts={
        "experts (resident)": resident_experts, **rest, **resident_lora, **dense_host, "activations": acts}), cuda,
        host_parts=tuple(dense_host))
    pins = 0
    for tier in ("host", "disk"):
        disk = tier == "disk"
        stream = Stream.of(w, layer_experts, layers, p, cache if disk else None, max(0, device_budget - at_bind))
        pins = stream.device_pins if tier == "host" else pins
        # one chunk's expert gradients (trained experts) or LoRA factor gradients (factors in the store) on the device
        grads = stream.chunk * (p if not w.frozen_experts else factors) * item if cuda else 0
        share = (stream.chunk or 1) / layer_experts if not keeps_graphs else 0.0  # a recomputed chunk's experts
        tier_acts = activation_parts(act_shape, tokens, item, w.gradient_checkpointing, keeps_graphs,
                                     w.loss_chunk_tokens, head, chunk_gradient_bytes=grads,
                                     gradient_bytes=gradient_bytes, chunk_share=share, adapters=adapters,
                                     late_gradient_bytes=late)
        store_part = "host cache" if disk else "expert store"
        parts = {store_part: cache * (record + copy) if disk else host_store, **rest, **lora_rest, **dense_host,
                 "activations": sum(tier_acts.values())}
        if store_factors:
            parts["expert LoRA factors (fp32 state, in the store)"] = store_factors * ADAM_BYTES_PER_PARAM
        if lora_factors:
            parts["LoRA factors (streamed pass)"] = lora_factors
        if cuda:
            parts["slab"] = stream.slab_bytes
            # the stager's ring of device slots (offload/streaming/transfers.py DeviceStager): an expert at a time
            parts["stager slots"] = (clamp_depth(w.prefetch_depth, cache if disk else None) + 1) * aligned_nbytes(
                p, w.dtype)
            if store_factors:  # uploaded with their chunk into the slab's two blocks' companions
                parts["slab: LoRA factors"] = 2 * stream.chunk * factors * item
            if stream.device_pins:
                parts["device pins (state)"] = stream.device_pins * p * (ADAM_BYTES_PER_PARAM + (copy // p))
        elif disk:
            parts["staging block"] = staging
        needs = TierNeeds(tier, 0, 0, n_experts * record if disk else 0, parts=parts, activations=tier_acts,
                          chunk_gradient_bytes=grads, chunk_share=share)
        if cuda:
            # the dense optimizer on the host: the dense gradients down and the weights up once per window
            dense_moved = non_expert * item // w.micro_batches if dense_host else 0
            # the factors in the store go up with every chunk (no block keeps them); the experts' copies as the slab
            # reuses them
            needs.h2d_bytes_per_step = int(stream.uploads(w.gradient_checkpointing, w.frozen_experts) * upload
                                           + stream.uploads(w.gradient_checkpointing) * factors * item) + dense_moved
            needs.d2h_bytes_per_step = (n_experts - stream.device_pins) * (p if not w.frozen_experts else factors) * item
            needs.d2h_bytes_per_step += dense_moved
        if disk:
            if w.frozen_experts:
                sweeps = 3 if w.gradient_checkpointing else 2  # forward, the checkpoint's recompute, backward
                needs.disk_read_bytes_per_step = sweeps * max(0, n_experts - cache) * record
            else:
                needs.disk_read_bytes_per_step, needs.disk_write_bytes_per_step = trained_disk_traffic(
                    w, n_experts, layer_experts, layers, cache, row=4 * p)
        tiers[tier] = _place(needs, cuda, host_parts=(store_part, *dense_host,
                                                      "expert LoRA factors (fp32 state, in the store)"))

    for needs in tiers.values():
        share = needs.chunk_share
        needs.largest_batch = _largest_batch(act_shape, w, item, keeps_graphs, head, gradient_bytes, share,
                                             adapters, late, needs, device_budget)

    est = MemoryEstimate(expert_params, non_expert, n_experts, acts,
                         ADAM_BYTES_PER_PARAM if not w.frozen_experts else record / p)
    auto, why = choose_tier(est, device_budget, host_budget)
    if auto == "device" and quantization is not None:  # the quantized format is the store's (OffloadConfig)
        auto, why = "host", f"{w.expert_storage} experts live in the offloaded store; " + why
    over = tiers[auto].device_bytes - HEADROOM * device_budget
    if cuda and over > 0:
        fits = tiers[auto].largest_batch
        why += (f"; but it needs {tiers[auto].device_bytes / GiB:.2f} GiB on the GPU, over the budget: "
                + (f"the largest batch that fits is {fits['without checkpointing']} without activation checkpointing"
                   f" and {fits['with checkpointing']} with it" if fits else "lower the batch")
                + (" (--gradient-checkpointing)" if not w.gradient_checkpointing else ""))
        engine = sum(tiers[auto].parts.get(k, 0) for k in ("slab", "device pins (state)"))
        room = int(engine - over)
        if engine and room >= slab_nbytes(2, p, w.dtype):  # two chunks of two: the smallest slab
            why += (f"; or a smaller slab and fewer pins: --device-budget-mb {room // 2**20} (device_budget_bytes) "
                    "leaves the step its room")

    host_over = tiers[auto].host_bytes - HEADROOM * host_budget
    if auto == "disk" and host_over > 0:
        per_record = record + copy
        room = max(0, cache - math.ceil(host_over / per_record))
        why += (f"; its host figure ({tiers[auto].host_bytes / GiB:.2f} GiB) exceeds {HEADROOM:.0%} of host memory: "
                f"a host cache of at most {room} experts fits (--host-cache-experts)")
    flops = step_flops(shape, w.batch_size, w.seq_len, train_experts=not w.frozen_experts,
                       train_rest=not w.frozen_experts, lora_dense=lora_dense, lora_expert=lora_expert,
                       lora_r=w.lora_r, experts_recompute=not keeps_graphs,
                       checkpointing=w.gradient_checkpointing)
    decode = []
    if rates is not None and cuda:
        tokens = w.batch_size * w.seq_len
        for needs in tiers.values():
            resident = needs.tier == "device"
            adam = 0 if resident or w.frozen_experts else (n_experts - pins) * p
            if not resident:  # the options' host-stepped state: the dense optimizer, the experts' LoRA factors
                adam += (non_expert if dense_host_on else 0) + store_factors
            # the disk tier's traffic, counted for every micro-batch (trained experts' write-backs come once per window:
            # with accumulation an upper bound)
            disk = needs.disk_read_bytes_per_step + needs.disk_write_bytes_per_step
            step_fl = flops if not resident else step_flops(
                shape, w.batch_size, w.seq_len, train_experts=not w.frozen_experts, train_rest=not w.frozen_experts,
                lora_dense=lora_dense, lora_expert=lora_expert, lora_r=w.lora_r, experts_recompute=False,
                checkpointing=w.gradient_checkpointing)
            needs.time = step_time(step_fl, tokens, rates, h2d=needs.h2d_bytes_per_step,
                                   d2h=needs.d2h_bytes_per_step, host_adam_params=adam,
                                   micro_batches=w.micro_batches, disk_bytes=disk)
        decode = [decode_time(shape, upload, item, rates, hit) for hit in (0.0, 0.5)]
    return Estimate(getattr(config, "model_type", "?"), expert_params, non_expert, lora, n_experts, layers, p,
                    record, cache, tiers, auto, why, w, flops=flops, device_pins=pins, rates=rates, decode=decode,
                    device_budget=device_budget)


def _largest_batch(act_shape: ActivationShape, w: Workload, item: int, keeps_graphs: bool, head: bool,
                   gradient_bytes: int, share: float, adapters: Adapters, late: int, needs: TierNeeds,
                   device_budget: int) -> dict[str, int]:
    """The largest batch of `w.seq_len`-token sequences whose device figure fits the budget, without and with
    activation checkpointing: the activations grow with the batch (the loss's chunk up to its size), the rest does
    not."""
    if w.device != "cuda":
        return {}
    fixed = needs.device_bytes - needs.parts["activations"]
    room = HEADROOM * device_budget - fixed
    out = {}
    for label, ckpt in (("without checkpointing", False), ("with checkpointing", True)):
        def acts(b: int) -> int:
            return sum(activation_parts(act_shape, b * w.seq_len, item, ckpt, keeps_graphs, w.loss_chunk_tokens,
                                        head, needs.chunk_gradient_bytes, gradient_bytes, share,
                                        adapters, late).values())
        lo, hi = 0, 1
        while acts(hi) <= room:  # the activations grow with the batch: double, then bisect
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if acts(mid) <= room else (lo, mid)
        out[label] = lo
    return out


def needs_checkpointing(config, workload: Workload, tier: str, device_budget: int) -> bool:
    """Whether `tier`'s device figure for `workload` exceeds the budget without activation checkpointing and fits
    with it (the jobs' `--gradient-checkpointing auto`)."""
    without = dataclasses.replace(workload, gradient_checkpointing=False)
    est = estimate(config, without, device_budget=device_budget, host_budget=1 << 50)
    return est.tiers[tier].device_bytes > HEADROOM * device_budget


def _place(needs: TierNeeds, cuda: bool, host_parts: tuple[str, ...] = ()) -> TierNeeds:
    """Sum the parts into device and host bytes: on a GPU what is not a host part is on the device; on the CPU
    everything is host memory (the device is the host)."""
    for name, nbytes in needs.parts.items():
        if cuda and name not in host_parts:
            needs.device_bytes += nbytes
            needs.device_parts.append(name)
        else:
            needs.host_bytes += nbytes
    return needs


def _cuda_free() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    raise UserError("no GPU here to read its free memory from: give --gpu-memory GB (or --device cpu)")


# peft's counts by (config, method, r): wrapping a meta model costs seconds per call, and a table (docs/hardware.md)
# asks for the same model and method under several expert storages and options, which do not change the adapters.
_LORA_COUNTS: dict[tuple[str, str, int], tuple] = {}


def _lora_params(model, w: Workload) -> tuple[int, int, list[tuple[int, int]], list[tuple[int, int]]]:
    key = (model.config.to_json_string(), w.method, w.lora_r)
    if key not in _LORA_COUNTS:
        if len(_LORA_COUNTS) >= 64:
            _LORA_COUNTS.clear()
        _LORA_COUNTS[key] = _count_lora_params(model, w)
    total, on_experts, dense, on_expert = _LORA_COUNTS[key]
    return total, on_experts, list(dense), list(on_expert)


def _count_lora_params(model, w: Workload) -> tuple[int, int, list[tuple[int, int]], list[tuple[int, int]]]:
    """peft's trainable parameters for the method (the jobs' targets), counted on the meta model (peft builds its
    adapters there): (all of them, those on the experts' tensors, (in, out) of each adapted dense matrix of one
    decoder layer stack, (in, out) of each adapted matrix of one expert)."""
    from peft import LoraConfig, get_peft_model

    from ..families.moe_path import find_experts_modules
    from ..offload.lora.expert_lora import expert_target_parameters
    from ..quiet import peft_wrapping

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    modules = [m for m in LORA_ATTENTION if m in names]
    parameters = expert_target_parameters(model) if w.method == "lora-experts" else []
    if not modules and not parameters:
        return 0, 0, [], []
    experts = {name for name, _ in find_experts_modules(model)}
    with torch.device("meta"), peft_wrapping():  # peft makes its adapters where the factories default to
        peft_model = get_peft_model(model, LoraConfig(r=w.lora_r, lora_alpha=2 * w.lora_r, target_modules=modules,
                                                      target_parameters=parameters or None))
    total = on_experts = 0
    dense: list[tuple[int, int]] = []
    for name, t in peft_model.named_parameters():
        if t.requires_grad:
            total += t.numel()
            # peft's wrappers sit at the experts module's place: base_model.model.<experts module path>.lora_*
            on_experts += t.numel() * any(f".{e}." in name for e in experts)
    for name, module in peft_model.named_modules():
        if hasattr(module, "in_features") and hasattr(module, "lora_A") and not any(f".{e}" in name for e in experts):
            dense.append((module.in_features, module.out_features))
    # one expert's adapted matrices: the 3-D tensors' per-expert shapes (E, out, in) or transposed; r (in + out) either
    # way
    first = find_experts_modules(model)[0][1]
    suffixes = {p.rsplit(".", 1)[-1] for p in parameters}
    on_expert = [tuple(getattr(first, n).shape[1:]) for n in sorted(suffixes) if hasattr(first, n)]
    return total, on_experts, dense, on_expert


# OffloadConfig's fields that are flags of `estimate` (and Workload's fields of the same names), generated from the
# fields (hf_moe_offload.cli.flags: name, type, choices and help as `train`'s; the CLI is cli/estimate.py).
FLAG_FIELDS = ("expert_storage", "host_cache_experts", "pin_fraction", "device_budget_bytes", "lora_in_store",
               "dense_optimizer_on_host")


__all__ = ["Estimate", "FLAG_FIELDS", "TierNeeds", "Workload", "estimate", "meta_model", "needs_checkpointing"]
