"""Third-party messages that no user of this package asked for, dropped where they are emitted.

bitsandbytes logs a warning from `bitsandbytes.backends.cpu.ops` as it is imported on a CPU with AVX512-BF16 when the
optional `kernels` package is missing: its fused CPU 4-bit GEMM would come from the Hub through `kernels`; without it
bitsandbytes runs its own CPU kernels, which is what this package uses (quantized experts are dequantized per chunk,
`offload/stores/quantized.py`). peft imports bitsandbytes when peft itself is imported, and transformers' `Trainer` imports
peft, so the warning would open every command of the CLI and every `import hf_moe_offload`, `--help` included.

Importing this module (the package's `__init__` does, first) runs `quiet_bitsandbytes_import()`, which filters that
one record (matched by logger and message) and logs it again at DEBUG under this package's logger; every other
bitsandbytes message passes. The filter is attached to the logger by name, so it holds whoever imports bitsandbytes
first (peft, transformers or this package).

`peft_wrapping()` is the context for `peft.get_peft_model`: peft (0.21) reads the model's `is_gradient_checkpointing`
as it wraps it, a name transformers 5.24 deprecates for `is_activation_checkpointing` with a FutureWarning on every
read. The warning is about peft's code, which no user of this package can change; inside the context that one
warning is ignored.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

BITSANDBYTES_CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"
# The start of the message bitsandbytes (0.49, 0.50) logs when `kernels` cannot provide its CPU gemm_4bit kernel.
MISSING_CPU_KERNEL_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _MissingCpuKernelFilter(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward" warning (re-logged at DEBUG) and passes the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(MISSING_CPU_KERNEL_MESSAGE):
            logger.debug("bitsandbytes: %s (its own CPU kernels are used)", record.getMessage())
            return False
        return True


def quiet_bitsandbytes_import() -> None:
    """Attach the filter to bitsandbytes' CPU-ops logger once (idempotent); call it before peft or bitsandbytes is
    imported."""
    target = logging.getLogger(BITSANDBYTES_CPU_OPS_LOGGER)
    if not any(isinstance(f, _MissingCpuKernelFilter) for f in target.filters):
        target.addFilter(_MissingCpuKernelFilter())


quiet_bitsandbytes_import()


@contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around `peft.get_peft_model`: ignores transformers' FutureWarning for peft's read of `is_gradient_checkpointing`
    (and no other warning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


__all__ = ["quiet_bitsandbytes_import", "peft_wrapping", "BITSANDBYTES_CPU_OPS_LOGGER", "MISSING_CPU_KERNEL_MESSAGE"]
