"""The chunk sources: each call's experts brought where they compute, chunk by chunk (ES-MoE §4.1).

`ChunkSources.stream_chunks` yields a call's chunks from the source its `ChunkPlan` names (the plan's
`grouped_source`, offload/plan.py): "slab" (a device's two blocks, offload/streaming/slab.py), "layer" (the host tier's (E, P)
block), "staged" (one by one through `one_by_one`, copied into the host staging block), "expert" (one by one
through `one_by_one`: the stager's slots on a device, the record or its mapped file on the host). The next experts are
read ahead (disk reads on background threads) and, on a device, uploaded on a side stream while the current ones
compute; a backward takes them again in reverse. The engine (offload/engine.py) hands the sources what they use: the
shared resources (offload/resources.py: the store, stager, slab and device pins), the layers, the counters, the update
ledger, the decoding path and the pins, its `release_after`, and at bind the gradient sink.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import torch

from ..plan import Phase, Source
from ..stores.store import WEIGHTS, WEIGHTS_AND_GRAD, ExpertKey, ExpertRecord
from .streamed import Segment


class ChunkSources:
    def __init__(self, resources, layers: list, stats, ledger, decoding, pins, release_after):
        self.res = resources  # the store, stager, slab and device pins the chunks come through (offload/resources.py)
        self.layers = layers  # the engine's OffloadedExpertsLayers, by index
        self.stats = stats
        self.ledger = ledger  # pending updates to wait for; whether the optimizer steps in this backward
        self.decoding = decoding  # the inference call's mode and device cache (offload/inference/decoding.py)
        self.pins = pins  # admits the device pins at a training forward (offload/pins/pinning.py)
        self.release_after = release_after  # the engine's: a record back to the store once its upload happened
        self.gradients = None  # the plan's gradient sink, at bind: takes back what an interrupted stream acquired
        self.peak_in_flight = 0  # the most experts one `one_by_one` had in flight at once (tests, benchmarks)
        self._staging: torch.Tensor | None = None
        self._by_name = {Source.SLAB: self._slab_chunks, Source.LAYER: self._layer_chunk,
                         Source.STAGED: lambda layer, chunks, phase: self._expert_chunks(layer, chunks, phase, True),
                         Source.EXPERT: lambda layer, chunks, phase: self._expert_chunks(layer, chunks, phase, False)}

    def bind(self, gradients) -> None:
        """The gradient sink the engine's plan chose at bind (offload/streaming/gradients.py)."""
        self.gradients = gradients

    def staging_block(self) -> torch.Tensor:
        """(stage_experts, P) in the store's compute dtype, each row 64-byte aligned: the weights of a staged chunk."""
        if self._staging is None:
            numel, dtype = self.res.store.numel, self.res.store.compute_dtype
            stride = -(-numel * dtype.itemsize // 64) * 64 // dtype.itemsize
            self._staging = torch.empty(self.res.stage_experts * stride, dtype=dtype).as_strided(
                (self.res.stage_experts, numel), (stride, 1))
        return self._staging

    def one_by_one(self, layer: int, expert_ids: list[int], keep: bool = False,
                   phase: Phase = Phase.INFERENCE) -> Iterator:
        """Yields each expert's compute weights in order, `depth` experts ahead; with keep=True also the record,
        which the caller must hand back (the engine's `gradients`: `chunk_arrived`, `release_record`; backward).
        `phase` tells the store what comes next (`_schedule`)."""
        res = self.res
        keys = [(layer, e) for e in expert_ids]
        # Only the rows this phase uses: weights; in a training backward `backward_rows`.
        rows = self.backward_rows(layer) if keep else WEIGHTS
        # A forward computes uncached experts from their mapped files: nothing for it to acquire or release.
        mapping = res.map_files and not keep
        if res.store.wants_schedule and not self.decoding.inference:  # decoding: the decode cache's scores instead
            res.store.set_schedule(self._schedule(layer, keys, phase))
        cache = self.decoding.device_cache if phase == Phase.INFERENCE else None
        self.read_ahead(keys, rows, mapping)
        if phase == Phase.FORWARD and mapping:
            res.store.write_behind()  # the I/O threads have nothing else to do until the backward
        inflight: deque = deque()
        held = [0]  # entries of `inflight` holding a store record
        nxt = 0
        t_start = time.perf_counter()
        stager = res.stager
        pins = res.device_pins
        if pins is not None and phase == Phase.FORWARD:
            self.pins.admit(keys)
        stager.timer.settle()

        def issue() -> None:
            nonlocal nxt
            key = keys[nxt]
            nxt += 1
            t0 = time.perf_counter()  # host-side waits: the expert's update, a disk read
            self.ledger.wait_for_update(key)
            mapped = res.store.map_weights(key) if mapping else None
            if pins is not None and key in pins:  # its state is on the device: nothing acquired or uploaded
                inflight.append((key, None, pins.weights(key), None, None, False))
            elif cache is not None and (hit := cache.hit(key, res.store.versions[key])) is not None:
                inflight.append((key, None, *hit, False))  # decoding: current in the device cache, nothing moves
            elif mapped is not None:  # computed from its mapped file: nothing acquired, nothing to release
                inflight.append((key, None, mapped, None, None, True))
            else:
                record = res.store.acquire(key, rows)
                inflight.append((key, record, *stager.upload(key, record, cache), False))
                held[0] += 1
            self.stats.stall_seconds += time.perf_counter() - t0
            if nxt + res.depth < len(keys):
                self.prefetch(keys[nxt : nxt + res.depth + 1], rows, mapping)
            elif nxt == len(keys) and cache is not None:
                self.decoding.upload_guessed()  # pre-gating's uploads queue behind this layer's own

        def room() -> bool:
            """Whether to issue the next expert: while at most `depth` are in flight; decoding with the device cache
            enqueues a layer's uploads all at once (batched per layer), bounded only by the ring slots and the disk
            tier's records still held (what the cache serves or keeps holds neither)."""
            if cache is None or not inflight:
                return len(inflight) <= res.depth
            return stager.ring_in_flight <= res.depth and (res.store.tier == "host" or held[0] <= res.depth)

        try:
            while nxt < len(keys) or inflight:
                while nxt < len(keys) and room():
                    issue()
                self.peak_in_flight = max(self.peak_in_flight, len(inflight))
                key, record, weights, ready, done, mapped = inflight.popleft()
                held[0] -= record is not None
                stager.wait(ready, weights)  # device-side wait: timed with events
                handed_over = False
                try:
                    if keep:
                        handed_over = True
                        yield weights, record
                    else:
                        yield weights
                finally:
                    if done is not None:
                        done()  # compute's last use of the upload is enqueued
                    if mapped and not self.decoding.inference:  # decoding reuses its hot experts' pages
                        res.store.unmap_weights(weights)
                    if not handed_over and record is not None:
                        self.release_after(key, ready)
        finally:
            for key, record, _weights, ready, done, _mapped in inflight:  # interrupted: hand back what was acquired
                if done is not None:
                    done()  # never used by compute: the slot is free again
                if record is not None:
                    self.release_after(key, ready)
            self.stats.compute_seconds += time.perf_counter() - t_start

    def stream_chunks(self, layer: int, source: Source, chunks: list[list[Segment]], phase: Phase) -> Iterator:
        """The weights of each chunk of `layer`'s segments where the experts compute, in the given order (a backward
        passes them reversed): yields (chunk, weights, records). `source` (streamed.ChunkPlan): "slab" (a device block,
        `_slab_chunks`), "layer" (the host tier's (E, P) block, `_layer_chunk`), "staged" (one by one through
        `one_by_one`, copied into the staging block), "expert" (one by one through `one_by_one`). `weights`: the
        chunk's (k, P) weights, or for "expert" the expert's (P,) weights. In a "backward" the
        caller owns `records` (one per segment; None where nothing was acquired: a device-pinned expert, an expert
        without tokens) and hands them over with the gradients (`gradients.chunk_arrived`) or releases them
        (`gradients.release_record`); in a "forward" or "inference" `records` is None and the stream hands them back
        itself."""
        return self._by_name[source](layer, chunks, phase)

    def _layer_chunk(self, layer: int, chunks: list[list[Segment]], phase: Phase) -> Iterator:
        """The host tier computing on the host: every expert of the layer at once, from the store's (E, P) block,
        once their pending updates are in."""
        res = self.res
        (chunk,) = chunks
        t0 = time.perf_counter()
        for e, _, _ in chunk:
            self.ledger.wait_for_update((layer, e))
        self.stats.stall_seconds += time.perf_counter() - t0
        records = None
        if phase == Phase.BACKWARD:
            rows = self.backward_rows(layer)
            records = [res.store.acquire((layer, e), rows) if n_tokens else None for e, _, n_tokens in chunk]
        weights = res.store.grouped_weights(layer, used=0 if records is not None else sum(1 for s in chunk if s[2]))
        t_start = time.perf_counter()
        try:
            yield chunk, weights, records
        finally:
            self.stats.compute_seconds += time.perf_counter() - t_start

    def _expert_chunks(self, layer: int, chunks: list[list[Segment]], phase: Phase, staged: bool) -> Iterator:
        """Chunks of `one_by_one`: each expert's weights as they come (k = 1), or, `staged` (the disk tier computing on
        the host), a chunk's weights copied into the staging block as `one_by_one` yields them (its records go back to
        the cache as soon as they are copied in a forward)."""
        keep = phase == Phase.BACKWARD
        order = [e for chunk in chunks for e, _, _ in (reversed(chunk) if keep else chunk)]
        experts = self.one_by_one(layer, order, keep=keep, phase=phase)
        held: list[tuple[ExpertKey, ExpertRecord]] = []  # handed over by the stream for the chunk being staged
        try:
            for chunk in chunks:
                if not staged:
                    item = next(experts)
                    yield (chunk, item[0], [item[1]]) if keep else (chunk, item, None)
                    continue
                block = self.staging_block()
                records: list[ExpertRecord | None] = [None] * len(chunk)
                for i in (reversed(range(len(chunk))) if keep else range(len(chunk))):
                    item = next(experts)
                    if keep:
                        item, records[i] = item
                        held.append(((layer, chunk[i][0]), records[i]))
                    block[i].copy_(item)
                held = []
                yield chunk, block[: len(chunk)], records if keep else None
        finally:
            for key, record in held:  # interrupted while staging: hand back what the stream handed over
                self.gradients.release_record(key, record)
            experts.close()

    def _slab_chunks(self, layer: int, chunks: list[list[Segment]], phase: Phase) -> Iterator:
        """The slab's pipeline (offload/streaming/slab.py): each chunk's weights in a device block, the next chunk's upload
        enqueued before this one is yielded (double buffering); a chunk a block still holds at the same versions (a
        backward's from its forward) is not uploaded again."""
        res = self.res
        keep = phase == Phase.BACKWARD
        slab, store, pins = res.slab, res.store, res.device_pins
        if pins is not None and phase == Phase.FORWARD:
            self.pins.admit([(layer, e) for chunk in chunks for e, _, _ in chunk])
        keys_all = [(layer, e) for chunk in chunks for e, _, _ in chunk if not res.on_device((layer, e))]
        rows_wanted = self.backward_rows(layer) if keep else WEIGHTS
        if store.wants_schedule and not self.decoding.inference:
            store.set_schedule(self._schedule(layer, keys_all, phase))
        self.read_ahead(keys_all, rows_wanted, False)
        t_start = time.perf_counter()
        slab.timer.settle()
        pending: deque = deque()  # (chunk, keys, records, weights, ready, index), at most two: one per block
        issued = 0
        try:
            while issued < len(chunks) or pending:
                while issued < len(chunks) and len(pending) < 2:
                    issued += 1
                    pending.append(self._upload_chunk(layer, chunks[issued - 1], chunks[issued : issued + 1],
                                                      rows_wanted, keep))
                chunk, keys, records, weights, ready, index = pending.popleft()
                slab.wait(index, weights)
                if pins is not None:
                    placed = [i for i, record in enumerate(records) if record is None]
                    pins.place(weights, placed, [keys[i] for i in placed])
                try:
                    yield chunk, weights, records if keep else None  # a backward's records are the caller's now
                finally:
                    slab.done(index)
                    if not keep:
                        for key, record in zip(keys, records):
                            if record is not None:
                                self.release_after(key, ready)
        finally:
            for _, keys, records, _, ready, _ in pending:  # interrupted: hand back what was acquired
                for key, record in zip(keys, records):
                    if record is not None:
                        self.release_after(key, ready)
            self.stats.compute_seconds += time.perf_counter() - t_start

    def _upload_chunk(self, layer: int, chunk: list[Segment], after: list[list[Segment]], rows_wanted,
                      backward: bool) -> tuple:
        """Acquire a chunk's records (once their updates are done), start reading the next chunk's (`after`), and
        enqueue its upload into the next slab block, unless a block still holds it ->
        (chunk, keys, records, weights, ready, block index)."""
        res = self.res
        store, slab, pins = res.store, res.slab, res.device_pins
        t0 = time.perf_counter()  # host-side waits: the experts' updates, disk reads
        keys = [(layer, e) for e, _, _ in chunk]
        records: list[ExpertRecord | None] = []
        try:
            for key in keys:
                if res.on_device(key):
                    records.append(None)
                    continue
                self.ledger.wait_for_update(key)
                records.append(store.acquire(key, rows_wanted))
            self.stats.stall_seconds += time.perf_counter() - t0
            ahead = [(layer, e) for c in after for e, _, _ in c if not res.on_device((layer, e))]
            if ahead:
                self.prefetch(ahead[: res.depth + 1], rows_wanted, False)
            held = [(key, pins.version(key) if record is None else record.version)
                    for key, record in zip(keys, records)]
            # A pass may find the chunk still in a block: no upload. A backward finds the forward's last chunks there,
            # and under activation checkpointing the recompute of the last layer finds the forward's.
            reused = slab.reuse(held)
            if reused is None:
                sources = []
                for (key, version), record in zip(held, records):
                    if record is None:  # placed from the device pins by compute (`_slab_chunks`)
                        sources.append((key, version, None, None))
                    elif key in res.stager.pinned_keys:  # its device copy (ES-MoE §4.3 pinning)
                        copy, copy_ready, _ = res.stager.upload(key, record)
                        sources.append((key, version, copy, copy_ready))
                    else:
                        sources.append((key, version, record.upload_source(), None))
                reused = slab.upload(sources, backward=backward)
        except BaseException:  # what was acquired goes back (after the compute enqueued so far, as a stream's would)
            for key, record in zip(keys, records):
                self.gradients.release_record(key, record)
            raise
        return (chunk, keys, records, *reused)

    def read_ahead(self, keys: list[ExpertKey], rows, mapped: bool) -> None:
        """Start reading the first `depth + 1` of `keys`, the experts a streamed loop is about to acquire. In inference
        the first one is left to the thread that computes it: handing it to an I/O thread and waiting costs two thread
        switches and overlaps next to nothing while decoding (few tokens)."""
        res = self.res
        first = 1 if self.decoding.inference else 0
        self._read(self._not_in_device_cache(keys)[first : res.depth + 1], rows, mapped)

    def prefetch(self, keys: list[ExpertKey], rows, mapped: bool) -> None:
        """Start reading `keys` into the store's cache; for a forward computing from `mapped` files, the kernel's
        read-ahead of their weights instead (a copy into the cache would not be used)."""
        self._read(self._not_in_device_cache(keys), rows, mapped)

    def _not_in_device_cache(self, keys: list[ExpertKey]) -> list[ExpertKey]:
        """Decoding: what the device cache holds needs no host copy (a read would evict one that does)."""
        cache = self.decoding.device_cache
        return keys if cache is None else [key for key in keys if key not in cache]

    def _read(self, keys: list[ExpertKey], rows, mapped: bool) -> None:
        res = self.res
        if mapped:
            res.store.advise(keys)
        else:
            res.store.prefetch(keys, rows)

    def backward_rows(self, layer: int) -> tuple[int, ...] | None:
        """The rows a training backward of `layer` reads (None: all): the weights and the gradient's row; also the
        Adam moments where the expert optimizer steps each expert in this backward (the layer's last call of the
        micro-step ends its window: `add_grad_hook`'s `steps_now`). ES-MoE §4.1: the step's reads then run ahead on
        the I/O threads with the weights', instead of on the optimizer's worker once the gradient is in, while the
        record is in the cache."""
        res = self.res
        if not res.train_experts:
            return WEIGHTS
        if (res.coordinator is None and self.layers[layer].in_last_backward
                and self.ledger.steps_now()):
            return None
        return WEIGHTS_AND_GRAD

    def _schedule(self, layer: int, current: list[ExpertKey], phase: Phase) -> list[ExpertKey]:
        """The acquisitions to come (ES-MoE's known order), for the disk tier's eviction: this call's experts, the
        rest of this pass, the backward in reverse (training), and the next step's passes up to this layer again.
        The experts of the other layers are predicted from their last routing."""
        def fwd(l: int) -> list[ExpertKey]:
            return [(l, e) for e, n in enumerate(self.layers[l].last_counts) if n]

        n = len(self.layers)
        if phase == Phase.FORWARD:
            passes = [fwd(l) for l in range(layer + 1, n)] + [fwd(l)[::-1] for l in reversed(range(n))]
            passes += [fwd(l) for l in range(layer + 1)]
        elif phase == Phase.BACKWARD:
            passes = [fwd(l)[::-1] for l in reversed(range(layer))] + [fwd(l) for l in range(n)]
            passes += [fwd(l)[::-1] for l in reversed(range(layer, n))]
        else:
            passes = [fwd(l) for l in range(layer + 1, n)] + [fwd(l) for l in range(layer + 1)]
        return list(current) + [key for keys in passes for key in keys]
