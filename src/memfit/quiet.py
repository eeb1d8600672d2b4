"""Importing torchao without the log records its import writes about itself (deferred: it takes seconds)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _DropRecords(logging.Filter):
    """Drops a logger's records whose message contains one of ``parts``."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


# What importing torchao logs about itself, none of it about the optimizers memfit uses from it (pure PyTorch):
_TORCHAO_IMPORT_NOISE = {
    # its C++/CUDA kernel libraries, which a CPU-only (or another CUDA) build of torch cannot load:
    # "Failed to load .../torchao/_C_mxfp8...so: Could not load this library: ...", and with an older torch
    # "Skipping import of cpp extensions due to incompatible torch version. Please upgrade to torch >= ..."
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    # torch's notice about torchao registering its enums: "<enum 'KernelPreference'> is an Enum subclass and is
    # now natively supported by torch.compile as an opaque value type. Calling register_constant() on Enum
    # subclasses is deprecated and will be an error in a future release."
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Import torchao inside this without the messages its import logs (:data:`_TORCHAO_IMPORT_NOISE`); any
    other record of those loggers still shows."""
    filters = {name: _DropRecords(*parts) for name, parts in _TORCHAO_IMPORT_NOISE.items()}
    for name, f in filters.items():
        logging.getLogger(name).addFilter(f)
    try:
        yield
    finally:
        for name, f in filters.items():
            logging.getLogger(name).removeFilter(f)
