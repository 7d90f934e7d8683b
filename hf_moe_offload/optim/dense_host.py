"""`HostDenseAdamW`: AdamW for the non-expert parameters with its state on the host (ZeRO-Offload's placement for the
dense weights; ES-MoE §4.1's overlap for their steps).

The device keeps each parameter's weights and, until the window's last micro-step, its gradient, both in the
weights' dtype (bf16 with `device_dtype=torch.bfloat16`). The host keeps the fp32 master weights and Adam's two
moments. On the micro-step that closes an accumulation window, each parameter's gradient is taken as soon as it is
final (its post-accumulate-grad hook): downloaded on a side stream, its device memory given back, and stepped on the
host by the optimizer's workers while the rest of backward runs; the new weights go up in the weights' dtype on the
same stream, and `step()` makes the compute stream wait for them before the next forward reads them.

Arithmetic: `torch.optim.AdamW(fused=True)` per tensor (the pure step of optim/adamw_step.py, which the expert
optimizer runs too); where the device weights are narrower than the master, the one-pass kernel writes their new value
in the pass that updates the master (optim/fused_adam.py). Global clipping needs every gradient first, so with
`max_grad_norm` the steps wait for `step()` (the backward still downloads and measures each gradient as it is final);
with offloaded experts, the expert optimizer's global norm includes these gradients (`ExpertOptimizer.step(dense=)`),
as `clip_grad_norm_` over the whole model would.

Ordering goes through the runtime (hf_moe_offload.runtime), so the simulated device checks it: the download waits for
the backward's event; a host step waits for its download and for the previous upload out of the same host buffer;
the compute stream waits for each upload.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..host_threads import DEVICE_THREADS, optimizer_threads
from ..runtime import HOST, Event, runtime_for
from .adamw_step import AdamWSettings, ExpertTensors, adamw_update_, clip_coefficient
from .step_queue import StepQueue, batch_size
from .window_clock import accelerate_sync_gradients

DENSE_STATE_FILE = "dense_state.safetensors"
DENSE_STATE_FORMAT = "hf_moe_offload.dense_state.v1"
# Worker threads where the optimizer has a pool of its own (with offloaded experts it shares the expert optimizer's).
WORKERS = 2


@dataclass(eq=False)
class _Slot:
    """One parameter's host state and the events of its transfers."""

    param: torch.nn.Parameter
    index: int  # the parameter's place in the optimizer (state_dict order)
    group: int
    master: torch.Tensor  # fp32, page-locked
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor  # the download's target, in the device gradient's dtype, page-locked
    grad32: torch.Tensor  # the fp32 gradient Adam reads (`grad` itself where that is fp32)
    copy: torch.Tensor | None  # the new weights in the device dtype, the upload's source (None: `master` is)
    step: int = 0
    downloaded: Event | None = None
    uploaded: Event | None = None  # the latest upload out of `copy` / `master`
    sq_norm: float | None = None  # deferred mode: the gradient's squared norm, float64

    @property
    def source(self) -> torch.Tensor:
        return self.master if self.copy is None else self.copy


class HostDenseAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 masters and moments live on the host; see the module docstring.

    `params`, `lr`, `betas`, `eps`, `weight_decay`: as `torch.optim.AdamW` (param groups included; the learning rate
    is read from each group at every step, so schedulers work). `device_dtype`: cast the device weights to this dtype
    (e.g. torch.bfloat16; the masters keep the fp32 values), None: keep theirs. `max_grad_norm`: clip by the global
    norm of these gradients (with an expert optimizer attached, of every gradient). `boundary_fn`: whether this
    backward closes the accumulation window (default: accelerate's `sync_gradients`, True outside accelerate).
    `workers`, `threads`: the pool and its OpenMP threads where no expert optimizer lends its own (default: 2 workers
    within the cores less those a device step keeps busy). Build it after the model's weights are loaded: the masters
    are copied from them here."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, device_dtype: torch.dtype | None = None,
                 max_grad_norm: float | None = None, boundary_fn: Callable[[], bool] | None = None,
                 workers: int | None = None, threads: int | None = None):
        if lr < 0 or eps < 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"HostDenseAdamW: invalid lr={lr}, betas={betas}, eps={eps} or "
                             f"weight_decay={weight_decay}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if device_dtype is not None and device_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"device_dtype must be torch.float32, bfloat16 or float16, got {device_dtype}")
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # DDP all-reduces a gradient after the hook that would take it here has run.
            raise ValueError("HostDenseAdamW runs in one process: under several processes (DDP), keep the dense "
                             "optimizer on the device (OffloadConfig.dense_optimizer_on_host=False)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        self.boundary_fn = boundary_fn or accelerate_sync_gradients
        self.last_grad_norm: float | None = None
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError(f"HostDenseAdamW: every parameter on one device, got {sorted(map(str, devices))}")
        self.runtime = runtime_for(devices.pop())
        self._stream = self.runtime.side_stream()  # None: inline, every copy complete when it returns
        self._slots: dict[torch.nn.Parameter, _Slot] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not p.is_floating_point() or not p.is_contiguous():
                    raise ValueError("HostDenseAdamW steps contiguous floating-point parameters")
                if p in self._slots:
                    raise ValueError("a parameter appears twice in HostDenseAdamW's groups")
                self._slots[p] = self._new_slot(p, len(self._slots), gi, device_dtype)
        self._queue = self._new_queue(lambda: WORKERS if workers is None else workers,
                                      lambda: optimizer_threads(threads, reserved=DEVICE_THREADS))
        self._jobs: list = []  # the Futures of the window's jobs (list.append: safe from the hooks' threads)
        self._taken: set[_Slot] = set()  # gradients claimed in the open window
        self._clip_coef: float | None = None  # handed over for this window by a global clip over more gradients
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._slots]

    def _new_slot(self, p: torch.nn.Parameter, index: int, group: int, device_dtype: torch.dtype | None) -> _Slot:
        rt = self.runtime
        master = rt.pinned_empty(p.shape, torch.float32)
        master.copy_(p.detach())
        if device_dtype is not None and p.dtype != device_dtype:
            p.data = p.data.to(device_dtype)
        dtype = p.dtype
        grad = rt.pinned_empty(p.shape, dtype)
        copy = None if dtype == torch.float32 else rt.pinned_empty(p.shape, dtype)
        return _Slot(p, index, group, master, torch.zeros_like(master), torch.zeros_like(master), grad,
                     grad if dtype == torch.float32 else torch.empty(p.shape, dtype=torch.float32), copy)

    def _new_queue(self, workers: Callable[[], int], threads: Callable[[], int]) -> StepQueue:
        return StepQueue(workers, self._run, lambda ready, n, held=False: batch_size(ready, n),
                         lambda slot, job: self._jobs.append(job), threads)

    # --- sharing the expert optimizer's workers and clipping ---
    def attach(self, expert_optimizer) -> None:
        """Step on `expert_optimizer`'s workers (one thread budget for both) and clip as it does: with its global
        clipping, by the coefficient its norm over every gradient gives (`ExpertOptimizer.step(dense=self)`)."""
        if expert_optimizer.grad_scaler is not None and expert_optimizer.grad_scaler.is_enabled():
            raise ValueError("HostDenseAdamW does not take fp16 loss scaling: train in bf16 or fp32")
        self.max_grad_norm = expert_optimizer.max_grad_norm
        if self.boundary_fn is accelerate_sync_gradients:
            self.boundary_fn = expert_optimizer.boundary_fn
        self._finish()
        self._queue.shutdown()
        self._queue = self._new_queue(lambda: expert_optimizer.workers, expert_optimizer.updates.optimizer_threads)
        self._lent = self._queue.executor = expert_optimizer._queue.pool

    @property
    def eager(self) -> bool:
        """Step during backward; with clipping, the steps wait for the norm over every gradient (`step()`)."""
        return self.max_grad_norm is None

    # --- backward ---
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.boundary_fn():
            self._take([self._slots[p]])

    @torch.no_grad()
    def _take(self, slots: list[_Slot]) -> None:
        """The gradients of `slots` are final: download them, give their device memory back, and step them (eager)
        or measure them (deferred) on the workers."""
        rt = self.runtime
        for slot in slots:
            if slot in self._taken:
                raise RuntimeError(
                    "a gradient accumulated again after HostDenseAdamW took it as final: either backward ran again "
                    "before step() closed the window (with gradient accumulation, pass boundary_fn or use "
                    "accelerate's accumulate(), so that only the window's last micro-step counts), or a gradient is "
                    "summed over several backward passes of one micro-step (reentrant checkpointing of a tied "
                    "weight: use use_reentrant=False)")
            self._taken.add(slot)
            grad = slot.param.grad
            rt.access(grad, write=True)  # autograd wrote it on the compute stream
            # The backward's last read of these weights (declared on the parameter itself, which lives as long as
            # the simulation must remember it): their upload comes after it.
            rt.access(slot.param)
            rt.wait_event(rt.record(), self._stream)
            rt.copy_(slot.grad, grad, stream=self._stream)
            if self._stream is not None:
                rt.record_stream(grad, self._stream)  # its memory is not reused before the download ran
            slot.downloaded = rt.record(self._stream)
            slot.param.grad = None
        self._queue.put([(slot,) for slot in slots], (self.eager,))

    def _run(self, entries: list[tuple[_Slot]], eager: bool) -> None:
        """A job: land these gradients, then step them (eager) or take their squared norms (deferred)."""
        slots = [slot for slot, in entries]
        for slot in slots:
            slot.downloaded.synchronize()
            self.runtime.access(slot.grad, stream=HOST)
            if slot.grad32 is not slot.grad:
                slot.grad32.copy_(slot.grad)
            if not eager:
                # As `global_clip` sums a resident gradient: float64 squares of the values in their own dtype.
                slot.sq_norm = float(slot.grad.double().pow(2).sum())
        if eager:
            self._step_slots(slots, None)

    @torch.no_grad()
    def _step_slots(self, slots: list[_Slot], clip_coef: float | None) -> None:
        """AdamW on the host, a fused call per param group, then each parameter's upload."""
        for slot in slots:
            if slot.uploaded is not None:
                slot.uploaded.synchronize()  # the previous upload read the buffer written below
            for t in (slot.master, slot.exp_avg, slot.exp_avg_sq) + ((slot.copy,) if slot.copy is not None else ()):
                self.runtime.access(t, write=True, stream=HOST)
        by_group: dict[int, list[_Slot]] = {}
        for slot in slots:
            by_group.setdefault(slot.group, []).append(slot)
        for gi, members in by_group.items():
            group = self.param_groups[gi]
            settings = AdamWSettings(tuple(group["betas"]), group["eps"], group["weight_decay"], True)
            tensors = [ExpertTensors([s.master], [s.grad32], [s.exp_avg], [s.exp_avg_sq], [True], s.step,
                                     None if s.copy is None else [s.copy]) for s in members]
            copied = adamw_update_(tensors, float(group["lr"]), settings, clip_coef=clip_coef)
            for s in members:
                s.step += 1
                if s.copy is not None and not copied:
                    s.copy.copy_(s.master)
        for slot in slots:
            self.runtime.copy_(slot.param, slot.source, stream=self._stream)
            slot.uploaded = self.runtime.record(self._stream)

    # --- closing the window ---
    def _late(self) -> list[_Slot]:
        """Gradients the backward left on the device (a parameter unused on the window's last micro-step)."""
        return [s for s in self._slots.values() if s.param.grad is not None and s not in self._taken]

    def grad_sq_norm(self) -> float:
        """The sum of the squared norms of this window's gradients (float64; after backward). Takes the gradients
        left on the device first."""
        if self.eager:
            raise RuntimeError("grad_sq_norm needs max_grad_norm (the gradients are stepped, not kept, otherwise)")
        self._take(self._late())
        self._finish()
        return sum(s.sq_norm for s in sorted(self._taken, key=lambda s: s.index))

    def clip_by(self, coef: float, total_norm: float) -> None:
        """This window's clip coefficient, from a global norm over more gradients than these (the expert
        optimizer's)."""
        self._clip_coef, self.last_grad_norm = coef, total_norm

    @torch.no_grad()
    def step(self, closure=None):
        """Close the window: step what backward did not (deferred: all, clipped), and make the compute stream wait
        for every upload."""
        loss = closure() if closure is not None else None
        if not self.boundary_fn():
            return loss  # not the window's last micro-step (e.g. inside accelerate's accumulate): keep accumulating
        late = self._late()
        if late:
            self._take(late)
        if not self.eager:
            coef = self._clip_coef
            if coef is None:
                total = math.sqrt(self.grad_sq_norm())
                coef, self.last_grad_norm = clip_coefficient(total, self.max_grad_norm), total
            self._finish()
            taken = sorted(self._taken, key=lambda s: s.index)
            self._queue.start([(s,) for s in taken], (coef,), self._step_clipped, one_each=False)
        self._finish()
        self._wait_uploads(self._taken)
        self._taken, self._clip_coef = set(), None
        return loss

    def _step_clipped(self, entries: list[tuple[_Slot]], coef: float) -> None:
        self._step_slots([slot for slot, in entries], coef)

    def _finish(self) -> None:
        """Wait for every job submitted so far (raising the first error of one)."""
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    def _wait_uploads(self, slots: Iterable[_Slot]) -> None:
        rt = self.runtime
        for slot in slots:
            rt.wait_event(slot.uploaded)
            rt.access(slot.param)  # the next forward's read

    def synchronize(self) -> None:
        """Every step and transfer done, for the host (before reading the masters or the weights)."""
        self._finish()
        for slot in self._slots.values():
            for event in (slot.downloaded, slot.uploaded):
                if event is not None:
                    event.synchronize()

    # --- state (checkpoints) ---
    def state_dict(self) -> dict:
        """torch's optimizer layout (`state` by parameter index, `param_groups`); each state holds the fp32 `master`
        beside `exp_avg`, `exp_avg_sq` and `step`. The host tensors themselves: copy before training on."""
        self.synchronize()
        state = {s.index: {"step": s.step, "master": s.master, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
                 for s in self._slots.values() if s.step}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._slots[p].index for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore `state_dict()`'s values (bit for bit) and upload the weights they give."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("HostDenseAdamW.load_state_dict: the saved param groups differ in size from these")
        self.synchronize()
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        by_index = {s.index: s for s in self._slots.values()}
        for slot in by_index.values():
            saved = state_dict["state"].get(slot.index)
            slot.step = int(saved["step"]) if saved else 0
            for name in ("master", "exp_avg", "exp_avg_sq"):
                if saved is not None:
                    value = saved[name]
                    if value.shape != slot.master.shape:
                        raise ValueError(f"HostDenseAdamW.load_state_dict: parameter {slot.index}'s {name} has shape "
                                         f"{tuple(value.shape)}, expected {tuple(slot.master.shape)}")
                    getattr(slot, name).copy_(value)
                elif name != "master":
                    getattr(slot, name).zero_()
            if saved is not None:
                self._upload_now(slot)
        self._wait_uploads(by_index.values())

    @torch.no_grad()
    def _upload_now(self, slot: _Slot) -> None:
        rt = self.runtime
        for t in (slot.master,) + ((slot.copy,) if slot.copy is not None else ()):
            rt.access(t, write=True, stream=HOST)
        if slot.copy is not None:
            slot.copy.copy_(slot.master)
        rt.access(slot.param)  # whatever read the old weights on the compute stream comes first
        rt.wait_event(rt.record(), self._stream)
        rt.copy_(slot.param, slot.source, stream=self._stream)
        slot.uploaded = rt.record(self._stream)

    def save(self, folder: str) -> str:
        """Write the state to `folder/dense_state.safetensors` atomically (a CRC32 per tensor): each parameter's
        rows [master, exp_avg, exp_avg_sq], the step counts and the param groups in the metadata."""
        from ..offload.stores.safetensors_io import write_safetensors_streaming

        self.synchronize()
        slots = sorted(self._slots.values(), key=lambda s: s.index)
        specs = [(f"param.{s.index}", torch.float32, (3, s.master.numel())) for s in slots]
        by_name = {f"param.{s.index}": s for s in slots}

        def chunks(name: str):
            slot = by_name[name]
            return (t.reshape(-1) for t in (slot.master, slot.exp_avg, slot.exp_avg_sq))

        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  | {"params": [self._slots[p].index for p in g["params"]]} for g in self.param_groups]
        meta = {"format": DENSE_STATE_FORMAT, "steps": json.dumps([s.step for s in slots]),
                "param_groups": json.dumps(groups)}
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, DENSE_STATE_FILE)
        write_safetensors_streaming(path, specs, chunks, meta)
        return path

    def load(self, folder: str) -> None:
        """Restore what `save` wrote (every tensor checked against its CRC32 before any is used)."""
        from ..errors import CheckpointError
        from ..offload.stores.safetensors_io import SafetensorsReader

        path = os.path.join(folder, DENSE_STATE_FILE)
        f = SafetensorsReader(path)
        meta = f.metadata
        if meta.get("format") != DENSE_STATE_FORMAT:
            raise CheckpointError(f"{path} is not a dense optimizer state written by hf_moe_offload")
        steps = json.loads(meta["steps"])
        if len(steps) != len(self._slots):
            raise CheckpointError(f"{path} holds {len(steps)} parameters' state, this optimizer {len(self._slots)}")
        rows = {}
        for s in self._slots.values():
            t = f.get(f"param.{s.index}")
            if t.shape != (3, s.master.numel()):
                raise CheckpointError(f"{path}: parameter {s.index} has {t.shape[-1]} elements, expected "
                                      f"{s.master.numel()}")
            rows[s.index] = t
        state = {i: {"step": steps[i], "master": r[0].view(self._slot_shape(i)),
                     "exp_avg": r[1].view(self._slot_shape(i)), "exp_avg_sq": r[2].view(self._slot_shape(i))}
                 for i, r in rows.items() if steps[i]}
        self.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})

    def _slot_shape(self, index: int) -> torch.Size:
        return next(s.master.shape for s in self._slots.values() if s.index == index)

    def close(self) -> None:
        """Finish what is in flight, take the hooks off the parameters and stop an own pool."""
        self.synchronize()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._queue.executor is not None and self._queue.executor is not getattr(self, "_lent", None):
            self._queue.shutdown()


def dense_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of `model` (offloaded experts are not parameters: their optimizer is the expert
    optimizer)."""
    return [p for p in model.parameters() if p.requires_grad]


__all__ = ["DENSE_STATE_FILE", "HostDenseAdamW", "dense_parameters"]
