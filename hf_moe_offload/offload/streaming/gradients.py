"""The gradient sinks: a chunk's expert gradients on their way into the records' fp32 gradient rows (ES-MoE §4.1).

The engine's plan picks one at bind (`OffloadPlan.gradients`): `HostGradients` where the host computes (autograd's
gradients land in the records on the thread that has them), `DeviceGradients` on a device (the chunk's gradients go
down as one block on the gradient stream, `GradRing`; device-pinned experts' stay on the device). Both hand final
gradients to the update ledger's hooks (the expert optimizer) and land what no hook takes. The engine composes the sink
at bind and hands it what it uses: the shared resources (offload/resources.py: the store, runtime, slab and device
pins), the layers and the update ledger; on a device also the counters and the engine's host worker and record release.
"""

from __future__ import annotations

import threading
import torch

from ..stores.store import GRAD, ExpertKey, ExpertRecord
from .streamed import Segment
from .transfers import GradArrival, GradRing


class HostGradients:
    """The host computes: each expert's slices of autograd's tensors are its arrival, landed where they are."""

    def __init__(self, resources, layers: list, ledger):
        self.res = resources  # the store and runtime these gradients go through (offload/resources.py)
        self.layers = layers  # the engine's OffloadedExpertsLayers, by index
        self.ledger = ledger  # the update ledger: its hooks take final gradients (offload/ledger.py)

    def chunk_arrived(self, layer: int, chunk: list[Segment], records: list[ExpertRecord | None],
                      grads: tuple[torch.Tensor, ...]) -> None:
        """A chunk's expert gradients ((k, ...) per tensor, layout order; none: frozen experts) with the records
        `stream_chunks` handed over with them."""
        routed = [i for i, (_, _, n_tokens) in enumerate(chunk) if n_tokens]
        keys = [(layer, chunk[i][0]) for i in routed]
        if not grads:
            for i, key in zip(routed, keys):
                self.release_record(key, records[i])
            return
        self._deliver(layer, chunk, routed, keys, records, grads)

    def _deliver(self, layer: int, chunk: list[Segment], routed: list[int], keys: list[ExpertKey],
                 records: list[ExpertRecord | None], grads: tuple[torch.Tensor, ...]) -> None:
        """The routed experts' (`routed`: their indices in the chunk) gradients handed over."""
        views = self.layers[layer].layout.views
        rt = self.res.runtime
        self.hand_over(layer, [(key, records[i], GradArrival.on_host(rt, [g[i] for g in grads], views))
                               for i, key in reversed(list(zip(routed, keys)))])

    def hand_over(self, layer: int, items: list[tuple[ExpertKey, ExpertRecord, GradArrival]]) -> None:
        """Gradients of `layer`'s experts on their way to the store (a chunk's at once, so that the expert optimizer
        can step them several per fused call): to the ledger's hooks if they are final, else (or what no hook takes)
        landed and released here."""
        for key, _, _ in items:
            self.res.store.has_grad[key] = True
        if self.layers[layer].in_last_backward:  # else more calls of this layer still run backward (partitions)
            items = self.ledger.offer(items)
        for key, record, arrival in items:
            self.land(key, record, arrival)

    def land(self, key: ExpertKey, record: ExpertRecord, arrival: GradArrival) -> None:
        arrival.land(record)
        self.res.store.release(key, dirty=(GRAD,))

    def release_record(self, key: ExpertKey, record: ExpertRecord | None) -> None:
        """Hand back a record the stream yielded, without a gradient (frozen experts). None: a device-pinned expert
        (nothing was acquired)."""
        if record is not None:
            self.res.store.release(key)


class DeviceGradients(HostGradients):
    """A device: the gradients of a chunk's experts with tokens go down as one (k, P) block on the gradient stream,
    each expert's row handed over as its arrival (landed by whoever takes it; the buffer is reused once all are);
    device-pinned experts' (record None) stay on the device, added in one indexed add (offload/pins/device_pins.py)."""

    ring_size = 4  # gradient download buffers in flight

    def __init__(self, resources, layers: list, ledger, stats, submit_host, release_after):
        super().__init__(resources, layers, ledger)
        self.stats = stats
        self.submit_host = submit_host  # the engine's host worker: lands a gradient once its download is done
        self.release_after = release_after  # the engine's: a record back to the store once its upload happened
        self.rings: dict[torch.dtype, GradRing] = {}  # by the dtype the GEMMs produced the gradients in

    def _deliver(self, layer: int, chunk: list[Segment], routed: list[int], keys: list[ExpertKey],
                 records: list[ExpertRecord | None], grads: tuple[torch.Tensor, ...]) -> None:
        res = self.res
        flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1)
        if len(routed) < len(chunk):
            flat = flat.index_select(0, torch.tensor(routed, device=flat.device))
        records = [records[i] for i in routed]
        on_device = [i for i, record in enumerate(records) if record is None]
        if on_device:  # device-pinned experts: their gradients stay on the device
            res.device_pins.add_grads([keys[i] for i in on_device],
                                         flat.index_select(0, torch.tensor(on_device, device=flat.device)))
            if len(on_device) == len(keys):
                return
            host = [i for i, record in enumerate(records) if record is not None]
            flat = flat.index_select(0, torch.tensor(host, device=flat.device))
            keys, records = [keys[i] for i in host], [records[i] for i in host]
        k = len(keys)
        ring = self.rings.get(flat.dtype)
        if ring is None:
            per_chunk = res.slab.experts if res.slab is not None else 1
            ring = self.rings[flat.dtype] = GradRing(res.runtime, per_chunk * res.store.numel, flat.dtype,
                                                     self.ring_size)
        block = ring.send(flat.reshape(-1))
        self.stats.d2h_bytes += flat.numel() * flat.element_size()
        if k == 1:
            self.hand_over(layer, [(keys[0], records[0], block)])
            return
        per_expert = block.buffer.view(k, res.store.numel).unbind(0)  # one op, not one per expert
        left = [k]
        lock = threading.Lock()

        def landed() -> None:  # the last row landed: the buffer goes back to the ring
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                block.release()

        self.hand_over(layer, [(key, record, GradArrival(res.runtime, per_expert[i], block.event, landed))
                               for i, (key, record) in enumerate(zip(keys, records))])

    def land(self, key: ExpertKey, record: ExpertRecord, arrival: GradArrival) -> None:
        """Landed on the engine's host worker, never on the compute thread (it waits for the download)."""
        self.ledger.grad_job(key, self.submit_host(super().land, key, record, arrival))

    def release_record(self, key: ExpertKey, record: ExpertRecord | None) -> None:
        """Handed back once the compute enqueued so far (which used its upload) has run."""
        if record is not None:
            self.release_after(key, self.res.runtime.record())
