"""`hf-moe-offload estimate --measure`: the step predicted from rates measured on this machine, not assumed.

The time model (time_model.py) bounds a step by floors at a peak rate times an assumed efficiency; on an H200 that
predicted 0.33 s for a measured 1.73 s offloaded step (benchmarks/RESULTS.md). Here the rates are measured on this
machine's device (the GPU where torch sees one, else the CPU), at the model's own shapes and the workload's
micro-batch, with models of the model's own class built from its config with one and with two decoder layers (random
weights, the compute dtype):

- **a layer**, forward and backward: the two-layer model's step less the one-layer model's, resident (the class's
  own experts); and with the experts in the package's store, streamed by the engine (host tier: the package's grouped
  path; on a GPU its uploads and gradient downloads), half the two-layer model's step less the rest;
- **the rest**: what the one-layer model's step takes beyond its layer (embedding, final norm, LM head, loss);
- **the device's AdamW** (torch's fused kernel) over the two-layer model's parameters;
- **the host Adam**: the package's `ExpertOptimizer` stepping the two layers' experts on the host, on the engine's
  workers with its kernel (deferred mode: one `step()` after backward, the same workers as the eager steps);
- **the link**: pinned copies host -> device and back (a GPU only; on the CPU there is no link).

Every timed function runs round after round in turn (`_interleaved`), so that a machine whose load drifts slows all
of them alike. The prediction is the time model's (`time_model.step_time`) fed with those rates: the compute floor is
the layers times the measured layer plus the rest and the device AdamW; the link the estimate's bytes at the measured
rates; the host Adam the trained experts at the measured rate. The floors overlap and the largest binds, as the engine
runs them: uploads behind compute, the host Adam on its workers behind backward (on the CPU the experts compute on one
thread fewer than torch's, leaving a core to it: `OffloadConfig.compute_threads`).

Simplified: every layer is timed as the measured MoE layer (a family's dense layers count as MoE layers); the
engine's per-step costs are in the offloaded layer's figure (counted per layer); where the two layers' experts would
not fit a quarter of this host's memory, they are measured with fewer experts (same top-k) and the host Adam's rate
is per parameter; full fine-tuning only; the disk tier is not measured.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..runtime import runtime_for
from .time_model import Rates, StepTime, step_time

# Attributes that hold a config's routed expert count, and those that make its first layers dense.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
DENSE_LAYER_FIELDS = {"first_k_dense_replace": 0, "mlp_only_layers": [], "decoder_sparse_step": 1}
LINK_BYTES = 1 << 28  # a copy large enough that its fixed cost is noise on a PCIe link


@dataclass
class Measured:
    """Rates measured on `device` for one micro-batch of `tokens` tokens (seconds, parameters/s, bytes/s)."""

    device: str  # where the model computed: "cuda (<name>)" or "cpu"
    dtype: str
    tokens: int
    experts_measured: int  # the measured layer's experts (the model's, or fewer where they would not fit)
    layer_s: float  # one decoder layer, forward and backward, resident
    layer_forward_s: float  # its forward alone (what activation checkpointing recomputes)
    offloaded_layer_s: float  # the same layer with its experts streamed by the engine (host tier)
    rest_s: float  # embedding, final norm, LM head and loss: forward and backward
    device_adam_params_per_s: float  # torch's fused AdamW on the device
    host_adam_params_per_s: float  # the package's ExpertOptimizer on the host, the engine's workers
    h2d_bytes_per_s: float | None  # pinned copies; None: no link (the CPU computes)
    d2h_bytes_per_s: float | None
    seconds: float = 0.0  # how long measuring took
    alongside: dict[str, float] = dataclasses.field(default_factory=dict)  # `measure(alongside=)`'s medians

    @property
    def on_gpu(self) -> bool:
        return self.h2d_bytes_per_s is not None


def _interleaved(fns: dict, repeats: int, warmup: int, sync) -> dict[str, float]:
    """The median seconds of each function, run round after round in turn (a machine whose load drifts slows every
    function alike), after `warmup` rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def one_layer_config(config, max_experts: int | None = None, layers: int = 1):
    """`config` with `layers` decoder layers (default one), each an MoE layer, and at most `max_experts` routed
    experts."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    for name, value in DENSE_LAYER_FIELDS.items():
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    if max_experts is not None:
        for name in EXPERT_COUNT_FIELDS:
            if getattr(cfg, name, None):
                setattr(cfg, name, min(getattr(cfg, name), max_experts))
    if isinstance(getattr(cfg, "layer_types", None), list):  # per-layer lists match the layer count
        cfg.layer_types = (cfg.layer_types * layers)[:layers]
    cfg.use_cache = False
    return cfg


def _link_rates(runtime, repeats: int, nbytes: int = LINK_BYTES) -> tuple[float, float]:
    """Bytes per second of page-locked copies up to the device and back, through the package's device runtime (as the
    engine copies: on a copy stream of its own, waited for by an event), each direction timed to its completion."""
    stream = runtime.new_stream()
    host = runtime.pinned_empty((nbytes,), torch.uint8)
    dev = runtime.empty((nbytes,), torch.uint8, stream=stream, persistent=True)
    done = lambda: runtime.record(stream).synchronize()  # noqa: E731
    t = _interleaved({"up": lambda: runtime.copy_(dev, host, stream),
                      "down": lambda: runtime.copy_(host, dev, stream)}, repeats, 1, done)
    runtime.free(dev)
    return nbytes / t["up"], nbytes / t["down"]


def measure(config, dtype: torch.dtype, batch_size: int, seq_len: int, pin_fraction: float = 0.0,
            device: torch.device | None = None, host_budget: int | None = None, repeats: int = 5,
            warmup: int = 2, alongside: dict | None = None) -> Measured:
    """Time the model's layer shapes on `device` (default: cuda where present, else cpu) at `batch_size` x
    `seq_len` tokens (module docstring). `host_budget`: host bytes the measured layers' experts may take (default a
    quarter of the available memory). `alongside`: more functions timed in the same rounds (what the prediction is
    compared with, such as a training step: a change of the machine's load reaches both); their medians in
    `Measured.alongside`."""
    from transformers import AutoModelForCausalLM

    from ..families.moe_path import experts_layers
    from ..offload.api import enable_expert_offload
    from ..offload.config import OffloadConfig
    from ..offload.planner import ADAM_BYTES_PER_PARAM, detect_budgets
    from ..optim.expert_optimizer import ExpertOptimizer

    start = time.perf_counter()
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host_budget = host_budget or detect_budgets(torch.device("cpu"))[1] // 4

    (_, _, layout), = experts_layers(_meta_layer(config))
    # per expert of the two-layer models: the store's fp32 state, the weights of the four models, compute copies
    per_expert = layout.numel * (ADAM_BYTES_PER_PARAM + 4 * dtype.itemsize + dtype.itemsize)
    fits = max(_top_k(config), host_budget // (2 * per_expert))
    experts = min(layout.num_experts, fits)
    configs = {n: one_layer_config(config, max_experts=experts if experts < layout.num_experts else None, layers=n)
               for n in (1, 2)}

    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, configs[1].vocab_size, (batch_size, seq_len), generator=gen).to(device)

    def build(layers: int, offload: bool):
        torch.manual_seed(0)
        # each model its own config: the engine sets the experts implementation on the config its model holds
        model = AutoModelForCausalLM.from_config(copy.deepcopy(configs[layers])).to(dtype).train()
        engine = opt = None
        if offload:
            engine = enable_expert_offload(model, OffloadConfig(mode="host", pin_fraction=pin_fraction))
            opt = ExpertOptimizer(engine, lr=1e-6, defer_steps=True)  # its steps timed apart from backward
        return model.to(device), engine, opt

    models = {(1, False): build(1, False), (2, False): build(2, False), (2, True): build(2, True)}

    def step(key, backward: bool = True):
        model, engine, _ = models[key]
        with torch.set_grad_enabled(backward):
            loss = model(input_ids=batch, labels=batch).loss
        if backward:
            loss.backward()
        if engine is not None:
            engine.step_barrier()

    _, engine, experts_opt = models[(2, True)]

    def host_adam():
        experts_opt.step()
        engine.step_barrier()
        for model, _, _ in models.values():
            model.zero_grad(set_to_none=True)

    resident = models[(2, False)][0]
    device_adam = torch.optim.AdamW(resident.parameters(), lr=1e-6, fused=True)  # state made in the warm-up round
    fns = {f"{n} {kind}": (lambda n=n, bwd=bwd: step((n, False), bwd))
           for n in (1, 2) for kind, bwd in (("resident", True), ("forward", False))}
    fns["2 offloaded"] = lambda: step((2, True))
    fns.update({"device adam": device_adam.step, "host adam": host_adam})
    fns.update({f"alongside {name}": fn for name, fn in (alongside or {}).items()})
    t = _interleaved(fns, repeats, warmup, sync)
    for _, engine_, opt in models.values():
        if opt is not None:
            opt.close()
            engine_.synchronize()
    device_params = sum(p.numel() for p in resident.parameters())
    del models, resident, device_adam, engine, experts_opt

    h2d = d2h = None
    if cuda:
        h2d, d2h = _link_rates(runtime_for(device), repeats)
    layer = max(0.0, t["2 resident"] - t["1 resident"])
    rest = max(0.0, t["1 resident"] - layer)
    offloaded = max(0.0, t["2 offloaded"] - rest) / 2
    name = f"cuda ({torch.cuda.get_device_name(device)})" if cuda else "cpu"
    return Measured(device=name, dtype=str(dtype).removeprefix("torch."), tokens=batch_size * seq_len,
                    experts_measured=experts, layer_s=layer, layer_forward_s=max(0.0, t["2 forward"] - t["1 forward"]),
                    offloaded_layer_s=offloaded, rest_s=rest,
                    device_adam_params_per_s=device_params / t["device adam"],
                    host_adam_params_per_s=2 * experts * layout.numel / t["host adam"],
                    h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, seconds=time.perf_counter() - start,
                    alongside={name: t[f"alongside {name}"] for name in alongside or {}})


def _meta_layer(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one_layer_config(config))
    from ..families.moe_path import experts_layers

    if len(experts_layers(model)) != 1:
        raise UserError(f"{getattr(config, 'model_type', '?')}: one decoder layer of this config has no experts "
                        "module the package serves; --measure cannot time its MoE layer")
    return model


def _top_k(config) -> int:
    return int(getattr(config, "num_experts_per_tok", None) or getattr(config, "num_experts_per_token", None)
               or getattr(config, "moe_top_k", None) or getattr(config, "top_k", None) or 2)


def predict(est, m: Measured, layers: int) -> dict[str, StepTime]:
    """The device and host tiers' step (one optimizer window) for `est` (an `estimate.Estimate` of a full fine-tune of
    a model of `layers` decoder layers) from the rates in `m`: `time_model.step_time` with the compute, link and host
    Adam rates measured."""
    w = est.workload
    tokens = w.batch_size * w.seq_len
    recompute = layers * m.layer_forward_s if w.gradient_checkpointing else 0.0
    flops = est.flops.total  # only the unit of the compute rate handed to `step_time`
    out = {}
    for tier in ("device", "host"):
        needs = est.tiers[tier]
        resident = tier == "device"
        per_micro_batch = layers * (m.layer_s if resident else m.offloaded_layer_s) + m.rest_s + recompute
        device_params = est.non_expert_params + (est.expert_params if resident else 0)
        compute = w.micro_batches * per_micro_batch + device_params / m.device_adam_params_per_s
        adam_params = 0 if resident else (est.num_experts - est.device_pins) * est.params_per_expert
        h2d, d2h = (needs.h2d_bytes_per_step, needs.d2h_bytes_per_step) if m.on_gpu and not resident else (0, 0)
        rates = Rates(gpu="measured", gpu_tflops=flops * w.micro_batches / compute / 1e12, efficiency=1.0,
                      hbm_tbps=0.0, pcie_gbps=_link_gbps(m, h2d, d2h), host_adam_gps=m.host_adam_params_per_s / 1e9,
                      host_adam_source="measured here")
        st = step_time(_Flops(flops), tokens, rates, h2d=h2d, d2h=d2h, host_adam_params=adam_params,
                       micro_batches=w.micro_batches)
        out[tier] = st
    return out


def render_measured(est, m: Measured, steps: dict[str, StepTime]) -> str:
    w = est.workload
    link = (f"pinned copies {m.h2d_bytes_per_s / 1e9:.1f} GB/s up, {m.d2h_bytes_per_s / 1e9:.1f} GB/s down"
            if m.on_gpu else "no link (the CPU computes)")
    sliced = (f" (the measured layer had {m.experts_measured} of {est.num_experts // est.moe_layers} experts: "
              "more would not fit a quarter of host memory)" if m.experts_measured < est.num_experts // est.moe_layers
              else "")
    lines = ["",
             f"measured on {m.device} in {m.seconds:.0f} s, {m.dtype}, {m.tokens:,} tokens per micro-batch{sliced}:",
             f"  one layer forward+backward {m.layer_s * 1e3:,.1f} ms resident, {m.offloaded_layer_s * 1e3:,.1f} ms "
             f"with its experts streamed (forward {m.layer_forward_s * 1e3:,.1f} ms); embedding, head and loss "
             f"{m.rest_s * 1e3:,.1f} ms; device AdamW {m.device_adam_params_per_s / 1e9:.2f} G params/s; host Adam "
             f"{m.host_adam_params_per_s / 1e9:.2f} G params/s (the package's expert optimizer); {link}",
             "seconds per optimizer step from the measured rates (the floors overlap, the largest binds):",
             f"{'tier':<8}{'compute':>9}{'link':>9}{'host Adam':>11}{'step':>9}{'tokens/s':>11}  binds"]
    for tier, st in steps.items():
        f = st.floors
        lines.append(f"{tier:<8}{f['GPU compute']:>9.3f}{f['PCIe link']:>9.3f}{f['host Adam']:>11.3f}"
                     f"{st.window_s:>9.3f}{st.tokens_per_s:>11,.0f}  "
                     f"{st.binding if m.on_gpu else st.binding.replace('GPU compute', 'compute (CPU)')}")
    if not m.on_gpu:
        lines.append("measured on the CPU: this CPU's step, not a GPU's (no GPU compute, no link); a floor: it leaves "
                     "out the disk tier, data loading and anything outside forward, backward and the optimizers")
    else:
        lines.append("not yet compared with a measured GPU step (docs/estimate.md); the disk tier is not measured")
    if w.micro_batches > 1:
        lines.append(f"{w.micro_batches} micro-batches per step: compute and link per micro-batch, the Adams once")
    return "\n".join(lines)


@dataclass(frozen=True)
class _Flops:
    """`step_time` reads a micro-batch's FLOPs only to turn them into seconds at `Rates.flops_per_s`."""

    total: float


def _link_gbps(m: Measured, h2d: int, d2h: int) -> float:
    """One rate for `step_time`'s link floor (the larger direction's bytes over it) that gives the slower direction's
    measured time."""
    if not m.on_gpu or not (h2d or d2h):
        return 1.0
    seconds = max(h2d / m.h2d_bytes_per_s, d2h / m.d2h_bytes_per_s)
    return max(h2d, d2h) / seconds / 1e9


__all__ = ["Measured", "measure", "one_layer_config", "predict", "render_measured"]
