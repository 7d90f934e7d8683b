"""User-facing settings of the expert offload engine (ES-MoE §4.1, §4.3)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .stores.quantized import EXPERT_STORAGES, QUANTIZED_STORAGES

TIERS = ("device", "host", "disk")


@dataclass
class OffloadConfig:
    """Where expert state lives and how it is streamed.

    Example:

    ```python
    >>> from hf_moe_offload import OffloadConfig
    >>> OffloadConfig(mode="disk", offload_dir="/tmp/experts", host_cache_experts=8)
    ```
    """

    # --- tier ---
    mode: str = field(default="auto", metadata={
        "help": "where the experts' state lives (their weights; trained experts also their gradients and Adam "
                "moments): device, host or disk; auto picks from the memory budgets (ES-MoE §4.3 adaptive offload)",
        "flag": "--offload", "choices": ("auto",) + TIERS})
    offload_dir: str | None = field(default=None, metadata={"help": "directory of expert files (disk tier)"})
    host_cache_bytes: int | None = field(default=None, metadata={
        "help": "disk tier: host cache bound in bytes", "flag": "--host-cache-mb", "unit": "MiB",
        "exclusive": "host cache"})
    host_cache_experts: int | None = field(default=None, metadata={
        "help": "disk tier: host cache bound in experts. None (default, with no host_cache_bytes): a quarter of the "
                "experts, at least prefetch_depth + 2", "exclusive": "host cache"})
    # --- budgets for mode="auto" (detected when None) ---
    device_budget_bytes: int | None = field(default=None, metadata={
        "help": "device memory in bytes that mode='auto' plans with and, on a GPU, that the slab's two chunks and the "
                "pinned experts' state may take together. None (default): detected (mode='auto': the device memory "
                "free, the host's available memory on a CPU-only machine; the slab and the pins: a quarter of the "
                "memory free when the first forward binds the device)",
        "flag": "--device-budget-mb", "unit": "MiB"})
    host_budget_bytes: int | None = field(default=None, metadata={
        "help": "host memory in bytes that mode='auto' plans with (the host tier where the expert state fits in 90% "
                "of it, else the disk tier). None (default): the memory available, shared by the processes of the job "
                "on this machine",
        "flag": "--host-budget-mb", "unit": "MiB"})
    # --- streaming ---
    prefetch_depth: int = field(default=2, metadata={"help": "experts uploaded/read ahead of the one computing"})
    io_threads: int = field(default=2, metadata={"help": "background threads for disk reads and write-backs"})
    pin_fraction: float = field(default=0.25, metadata={
        "help": "ES-MoE §4.3: each layer's most-loaded experts kept resident (on a GPU in training with their whole "
                "state, stepped there, within the device budget the slab leaves)"})
    compute_dtype: torch.dtype | None = field(default=None, metadata={
        "help": "dtype of the streamed copies. None (default): the model's dtype, except on a GPU under autocast at the "
                "first forward, where the autocast dtype (the values autocast would cast to; half the bytes)",
        "no_flag": "--precision sets it (bf16: the streamed copies are bf16)"})
    train_experts: bool = field(default=True, metadata={
        "help": "False: the experts are frozen (e.g. LoRA on the other parts): the store keeps their weights only, "
                "no gradient and no Adam moments (a quarter of the memory), and backward computes no expert "
                "weight gradient",
        "no_flag": "--method sets it (lora freezes the experts)"})
    expert_storage: str = field(default="auto", metadata={
        "help": "how the store keeps frozen experts (train_experts=False): auto / bf16 (the model's own dtype), int8 "
                "(LLM.int8 row-wise) or nf4 (4-bit NormalFloat, blocks of 64), quantized by bitsandbytes when the "
                "store is filled and dequantized per chunk where the experts compute (offload/stores/quantized.py); the "
                "quantized formats need an offloaded tier (host or disk)",
        "choices": EXPERT_STORAGES, "group": "method"})
    lora_in_store: bool = field(default=False, metadata={
        "help": "peft's LoRA on offloaded experts: keep each expert's LoRA factors with the expert, fp32 masters, "
                "gradients and Adam moments in host memory, sent to the device per chunk in the compute dtype and "
                "stepped by the ExpertOptimizer (which the model then needs; the module's lora_A / lora_B become "
                "stand-ins, state_dict() still shows them; on the host or disk tier). False (default): they are "
                "ordinary parameters on the "
                "device, stepped by the dense optimizer. Attention LoRA stays on the device either way",
        "group": "method"})
    keep_activations: bool | None = field(default=None, metadata={
        "help": "keep each expert's middle activation for backward instead of recomputing it; the "
                "weights are not kept but taken from the backward's stream. None (default): keep where the experts "
                "compute on the CPU (host and disk tier), where it costs what the resident model saves; recompute on "
                "a device (ES-MoE keeps only the expert inputs there). The disk tier recomputes where the forward "
                "casts the weights (autocast to another dtype than compute_dtype), and quantized experts "
                "(expert_storage) always do: a kept graph would hold each dequantized expert. False forces the "
                "recompute"})
    stage_experts: int | None = field(default=None, metadata={
        "help": "experts per chunk of a training call's stream, uploaded or copied into one block and run as one "
                "grouped GEMM per matmul. The host tier on the CPU with quantized experts: None = 8 "
                "(dequantized into the block). On a GPU (host or disk tier): None (default) = a whole "
                "layer's experts, bounded by device_budget_bytes (else a quarter of the free device memory) for the "
                "slab's two blocks and, on the disk tier, by the host cache. On the CPU (disk tier): None = where the "
                "host cache holds at least half the experts, a third of it beside the reads ahead, at most 8; "
                "otherwise 1, one expert at a time, leaving the cache to the pins. A chunk's records stay in the "
                "cache from its backward until its optimizer step, so the cache must hold two chunks beside "
                "prefetch_depth + 1 (the pins get what is left)"})
    compute_threads: int | None = field(default=None, metadata={
        "help": "experts computing on the CPU (host and disk tier), training: intra-op threads of their forward and "
                "backward. None (default): one fewer than torch.get_num_threads() (at least 1), leaving a core to "
                "the expert optimizer's steps and the disk tier's I/O, which run alongside"})
    optimizer_threads: int | None = field(default=None, metadata={
        "help": "host threads of the expert optimizer's steps, all its workers together (each worker's OpenMP team "
                "is an even share, at least one). None (default): the cores this process may run on, less those the "
                "step's other work keeps busy: 2 where a device computes (the thread launching its work and "
                "autograd's), the experts' compute_threads where the CPU does"})
    dense_optimizer_on_host: bool | None = field(default=None, metadata={
        "help": "full fine-tuning: the non-expert parameters' fp32 master weights and Adam moments on the host, "
                "stepped there during backward beside the experts (ZeRO-Offload's placement); the device keeps their "
                "weights and gradients in the training dtype (bf16 under --precision bf16): 4 bytes a parameter "
                "instead of 16. None (default): on where the device's memory is bounded and the resident state would "
                "take more than half of device_budget_bytes (else of the memory free), off otherwise "
                "(plan.dense_on_host); OffloadTrainer builds the optimizer (optim/dense_host.py)"})
    # --- inference (generation, evaluation: offload/inference/policies.py) ---
    inference: bool | None = field(default=None, metadata={
        "help": "None (default): a call runs in inference mode under torch.no_grad() or model.eval() (the disk "
                "tier's cache scores experts by decayed use frequency with a per-layer budget; pre-gating reads the "
                "next layer's likely experts early); True/False force it",
        "no_flag": "a job's Trainer sets it: training steps run in training mode, its evaluations under "
                   "model.eval() and torch.no_grad()"})
    pregate: bool | None = field(default=None, metadata={
        "help": "inference: guess layer l+1's experts while layer l runs (its router on layer l's input, plus "
                "co-activation counts) and start reading them (disk tier) and, on a GPU, uploading them into the device "
                "cache; the outputs never depend on the guess. None "
                "(default): on where the experts compute on an asynchronous device (a GPU: early reads overlap the "
                "compute), off on the CPU, where the reads compete with the compute for the same cores (measured "
                "slower there, benchmarks/RESULTS.md); True/False force it"})
    decode_cache_decay: float = field(default=0.9, metadata={
        "help": "inference: per-token decay of an expert's use count in the disk tier's cache scores"})
    compute_on_host: bool | None = field(default=None, metadata={
        "help": "inference on a GPU: run a missed expert with few tokens on the host instead of uploading it, when a "
                "cost model measured at start says it is faster (Fiddler). None (default): on CUDA; True also on the "
                "simulated device"})
    device_cache_bytes: int | None = field(default=None, metadata={
        "help": "inference on a GPU: device memory for a cache of the experts decoding uses most (offload/"
                "device_cache.py), allocated when decoding starts and freed when training resumes. None (default): "
                "half the device memory free then (the other half left to the KV cache and activations); 0: none",
        "flag": "--device-cache-mb", "unit": "MiB"})
    mmap_weights: bool | None = field(default=None, metadata={
        "help": "disk tier on the CPU: a forward (inference, or training: only its backward needs the expert's "
                "record) computes an expert that is not in the cache straight from its memory-mapped file instead of "
                "copying it into the cache (the page cache is the host's cache; its checksum is still matched on "
                "first use). None (default): on where it applies; False: read through the cache, as on a GPU",
        "flag": "--mmap"})
    device: str | torch.device | None = field(default=None, metadata={
        "help": "where the model computes: mode='auto' plans with this device's memory, load_offloaded_pretrained "
                "moves the model there, and the first forward's inputs must be on it. None (default): the budgets "
                "are the current GPU's where there is one, else the CPU's, and the experts compute wherever the "
                "first forward's inputs are",
        "no_flag": "a job computes where its launcher puts each process (the Trainer's device)"})

    def __post_init__(self) -> None:
        if self.mode not in ("auto",) + TIERS:
            raise ValueError(f"OffloadConfig.mode must be one of auto, {', '.join(TIERS)}; got {self.mode!r}")
        if self.prefetch_depth < 1:
            raise ValueError(f"OffloadConfig.prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.stage_experts is not None and self.stage_experts < 1:
            raise ValueError(f"OffloadConfig.stage_experts must be >= 1 or None, got {self.stage_experts}")
        if self.compute_threads is not None and self.compute_threads < 1:
            raise ValueError(f"OffloadConfig.compute_threads must be >= 1 or None, got {self.compute_threads}")
        if self.optimizer_threads is not None and self.optimizer_threads < 1:
            raise ValueError(f"OffloadConfig.optimizer_threads must be >= 1 or None, got {self.optimizer_threads}")
        if self.io_threads < 1:
            raise ValueError(f"OffloadConfig.io_threads must be >= 1, got {self.io_threads}")
        if not 0.0 <= self.pin_fraction <= 1.0:
            raise ValueError(f"OffloadConfig.pin_fraction must be in [0, 1], got {self.pin_fraction}")
        if self.host_cache_bytes is not None and self.host_cache_experts is not None:
            raise ValueError("set only one of OffloadConfig.host_cache_bytes and OffloadConfig.host_cache_experts")
        if self.device_cache_bytes is not None and self.device_cache_bytes < 0:
            raise ValueError(f"OffloadConfig.device_cache_bytes must be >= 0 or None, got {self.device_cache_bytes}")
        for name in ("host_cache_bytes", "host_cache_experts", "device_budget_bytes", "host_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"OffloadConfig.{name} must be positive, got {value}")
        if self.mode == "disk" and not self.offload_dir:
            raise ValueError("OffloadConfig.offload_dir is required for mode='disk'")
        if not 0.0 < self.decode_cache_decay <= 1.0:
            raise ValueError(f"OffloadConfig.decode_cache_decay must be in (0, 1], got {self.decode_cache_decay}")
        if self.offload_dir is not None:
            self.offload_dir = os.fspath(self.offload_dir)
        if self.expert_storage not in EXPERT_STORAGES:
            raise ValueError(f"OffloadConfig.expert_storage must be one of {', '.join(EXPERT_STORAGES)}; got "
                             f"{self.expert_storage!r}")
        if self.expert_storage in QUANTIZED_STORAGES:
            if self.train_experts:
                raise ValueError(f"OffloadConfig.expert_storage={self.expert_storage!r} keeps frozen experts only "
                                 "(quantized weights are not updated): set train_experts=False (e.g. LoRA)")
            if self.mode == "device":
                raise ValueError(f"OffloadConfig.expert_storage={self.expert_storage!r} is a format of the offloaded "
                                 "store: use mode='host', 'disk' or 'auto' (which then picks host or disk)")

    def resolved_device(self) -> torch.device:
        return resolve_device(self.device)


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`device`, or by default the current GPU where there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
