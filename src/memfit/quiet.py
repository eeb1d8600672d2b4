"""Importing torchao and bitsandbytes without the log records their imports write about themselves (deferred: each
takes seconds). Each library's messages are listed below, matched by logger and text; any other record shows.
bitsandbytes is imported with its ``torch.compile`` calls deferred to the first call of what they wrap
(:func:`compile_on_first_call`): its import then takes ~0.03 s instead of ~1 s."""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any


class _DropRecords(logging.Filter):
    """Drops a logger's records whose message contains one of ``parts``."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


IMPORT_NOISE: dict[str, dict[str, tuple[str, ...]]] = {
    # What importing torchao logs about itself, none of it about the optimizers memfit uses from it (pure
    # PyTorch):
    "torchao": {
        # its C++/CUDA kernel libraries, which a CPU-only (or another CUDA) build of torch cannot load:
        # "Failed to load .../torchao/_C_mxfp8...so: Could not load this library: ...", and with an older torch
        # "Skipping import of cpp extensions due to incompatible torch version. Please upgrade to torch >= ..."
        "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
        # torch's notice about torchao registering its enums: "<enum 'KernelPreference'> is an Enum subclass and
        # is now natively supported by torch.compile as an opaque value type. Calling register_constant() on Enum
        # subclasses is deprecated and will be an error in a future release."
        "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    },
    # What importing bitsandbytes logs about itself, none of it about its optimizers:
    "bitsandbytes": {
        # on a CPU with AVX512-BF16 it looks for a 4-bit matmul kernel of the Hugging Face ``kernels`` package
        # (QLoRA inference in bitsandbytes' own Linear4bit, which memfit does not use): "Failed to load CPU
        # gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure you already
        # `pip install kernels` and the kernels >= 0.11.1"
        "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    },
}
"""library -> logger name -> parts of the messages its import logs that are dropped."""


@contextlib.contextmanager
def quiet_import(library: str) -> Iterator[None]:
    """Import ``library`` (a key of :data:`IMPORT_NOISE`) inside this without the messages its import logs; any
    other record of those loggers still shows, and after the block they all show again."""
    filters = {name: _DropRecords(*parts) for name, parts in IMPORT_NOISE[library].items()}
    for name, f in filters.items():
        logging.getLogger(name).addFilter(f)
    try:
        yield
    finally:
        for name, f in filters.items():
            logging.getLogger(name).removeFilter(f)


def quiet_torchao_import() -> contextlib.AbstractContextManager[None]:
    """:func:`quiet_import` of torchao."""
    return quiet_import("torchao")


@contextlib.contextmanager
def compile_on_first_call() -> Iterator[None]:
    """Inside this, ``torch.compile(fn, **options)`` of a plain function returns ``fn`` wrapped so that the first
    call compiles it (``torch.compile(fn, **options)`` then) and every call runs the compiled function: the same
    calls and results, without what ``torch.compile`` itself costs when a library applies it to its kernels at
    import (bitsandbytes' CPU kernels, decorated at import: ~1 s of ``torch._inductor`` imports, which an estimate
    on fake tensors never calls). Modules and anything else go to ``torch.compile`` at once."""
    import torch

    original = torch.compile

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(**options)
            return lambda fn: deferred(fn, **options)
        if not isinstance(model, types.FunctionType):
            return original(model, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = original(model, **options)
            return compiled(*args, **kwargs)

        return run

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = original


@contextlib.contextmanager
def quiet_bitsandbytes_import() -> Iterator[None]:
    """:func:`quiet_import` of bitsandbytes, its import-time ``torch.compile`` calls deferred
    (:func:`compile_on_first_call`)."""
    with quiet_import("bitsandbytes"), compile_on_first_call():
        yield
