"""`CudaRuntime`: the runtime interface over `torch.cuda` (streams, events, non-blocking copies, page-locked memory).

Page-locked host memory is registered in place with `cudaHostRegister` instead of being allocated by PyTorch's
caching host allocator, which rounds every block up to a power of two (a 75.6 MB expert record would take 128 MB)
and keeps freed blocks cached.
"""

from __future__ import annotations

import logging
import weakref

import torch

from .base import HOST, DeviceRuntime

logger = logging.getLogger(__name__)


class CudaRuntime(DeviceRuntime):
    name = "cuda"
    asynchronous = True

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def free_memory(self) -> int:
        """Free device memory, within this process's cap where one is set
        (`torch.cuda.set_per_process_memory_fraction`: the caching allocator refuses past it, whatever is free)."""
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        if fraction < 1.0:
            free = min(free, max(0, int(fraction * total) - torch.cuda.memory_reserved(self.device)))
        return free

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def run_on(self, stream, fn):
        with torch.cuda.stream(stream):
            return fn()

    def record(self, stream=None):
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.current_stream())
        return event

    def now_event(self, stream=None):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else self.current_stream())
        return event

    def wait_event(self, event, stream=None):
        if event is not None:
            (stream if stream is not None else self.current_stream()).wait_event(event)

    def wait_stream(self, stream, other):
        (stream if stream is not None else self.current_stream()).wait_stream(other)

    def copy_(self, dst, src, stream=None):
        if stream is None:
            dst.copy_(src, non_blocking=True)
        else:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

    def empty(self, shape, dtype, stream=None, persistent=False):
        if stream is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with torch.cuda.stream(stream):  # the caching allocator ties the block to the stream it is allocated on
            return torch.empty(shape, dtype=dtype, device=self.device)

    def pinned_empty(self, shape, dtype, cached=False):
        if cached:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return self.pin_(torch.empty(shape, dtype=dtype))

    def pin_(self, tensor):
        if tensor.numel() == 0 or tensor.is_pinned():
            return tensor
        if not tensor.is_contiguous():
            raise ValueError("pin_ needs a contiguous host tensor")
        cudart = torch.cuda.cudart()
        # Exactly the tensor's bytes (a row of a record pins that row's pages, not the record).
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            logger.warning("cudaHostRegister of %d bytes failed (error %s): copies from this buffer will be "
                           "synchronous", nbytes, int(err))
            return tensor
        # NOTE: unregistered when this tensor object dies: owners keep the tensor they pinned (not only views of it).
        weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
        return tensor

    def record_stream(self, tensor, stream):
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def access(self, tensor, write=False, stream=None):
        pass

    def elapsed(self, start, end):
        return start.elapsed_time(end) / 1e3


__all__ = ["CudaRuntime", "HOST"]
