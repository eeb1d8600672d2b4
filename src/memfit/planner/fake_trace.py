"""The environment a trace of the training step runs in (:func:`memfit.planner.estimate.estimate_run`): fake tensors,
a fake process group, host reads of a tensor's value, what gloo allocates, and the optimizer libraries' code tables
computed for real.

Nothing here decides bytes: these make the run's own step traceable on fake tensors as a real rank would run it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.memory import optimizers
from memfit.quiet import quiet_bitsandbytes_import, quiet_torchao_import

__all__ = ["GlooBuffers", "ScalarReads", "fake_ids", "fake_mode", "fake_process_group", "quiet"]


def fake_ids(batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """A ``(B, T)`` int64 batch of token ids (fake inside a ``FakeTensorMode``)."""
    return torch.randint(0, vocab_size, (batch_size, seq_len))


@contextlib.contextmanager
def fake_mode(optimizer_name: str) -> Iterator[Any]:
    """A ``FakeTensorMode`` (to enter where tensors are to be fake) in which the low-bit optimizers' quantization
    tables (a few hundred floats each,
    computed with data-dependent ops that fake tensors cannot run) are computed for real. Only the library that
    ``optimizer_name`` uses is imported (torchao and bitsandbytes take seconds each to import)."""
    with contextlib.ExitStack() as stack:
        library = optimizers.spec(optimizer_name).library
        if library == "torchao":
            _compute_torchao_tables()
        if library == "bitsandbytes":
            _real_bnb_dynamic_map(stack)
        yield FakeTensorMode(allow_non_fake_inputs=True)


def _compute_torchao_tables() -> None:
    """torchao's 8-bit and 4-bit code tables, computed once, for real (they are lru-cached)."""
    with contextlib.suppress(ImportError), quiet_torchao_import():
        import torchao.optim.subclass_4bit as ao4  # deferred: seconds to import, only for torchao optimizers
        import torchao.optim.subclass_8bit as ao8

        for table in (ao8.get_qmap_signed, ao8.get_qmap_unsigned, ao4.get_qmap_signed, ao4.get_qmap_unsigned):
            table()


def _real_bnb_dynamic_map(stack: contextlib.ExitStack) -> None:
    """Until ``stack`` closes, bitsandbytes computes its code tables (``create_dynamic_map``) for real."""
    with contextlib.suppress(ImportError), quiet_bitsandbytes_import():
        import bitsandbytes.functional as bnb_functional  # deferred: seconds to import, only for its optimizers

        original = bnb_functional.create_dynamic_map

        def real_dynamic_map(*args: Any, **kwargs: Any) -> torch.Tensor:
            with unset_fake_temporarily():
                return original(*args, **kwargs)

        bnb_functional.create_dynamic_map = real_dynamic_map
        stack.callback(setattr, bnb_functional, "create_dynamic_map", original)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers' "unpaged on CPU" and torch's fake-mode notes
        yield


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks in which this process is rank 0 and collectives do nothing
    (torch's testing ``fake`` backend), so FSDP shards and communicates as on rank 0 of a real run."""
    if world_size == 1:
        yield
        return
    # deferred: torch's testing internals are imported only by a sharded estimate, never by a training rank
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("estimate_run(world_size > 1) needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class ScalarReads(TorchDispatchMode):
    """Under the trace, a tensor's value read on the host (``.item()``, ``float(t)``) is 1 unless the fake tensor
    knows it: Adafactor reads each parameter's RMS, APOLLO its norm-growth limiter, to scale a step: a number that
    steers no shape and no allocation, which fake tensors cannot give. Entered inside the ``FakeTensorMode``, so
    that the read reaches this mode first."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and getattr(args[0], "constant", None) is None:
            tensor = args[0]
            if tensor.dtype == torch.bool:
                return True
            return 1.0 if tensor.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


class GlooBuffers(TorchDispatchMode):
    """What gloo, the backend of a sharded CPU run, allocates in a reduce-scatter over ``world_size`` ranks (a
    replica's under hybrid sharding), made under the fake process
    group (whose collectives allocate nothing): gloo's ``reduce_scatter_tensor_coalesced`` (which its
    ``_reduce_scatter_base`` calls; torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) clones each input, all-reduces
    the clone in place and, when the work is waited on, copies this rank's chunk of it to the output; the clone lives
    until the work is dropped. FSDP2 waits at once, so from the collective to just after it the rank holds one
    more copy of the reduce-scatter input: a whole group's unsharded gradients (the root's embedding and
    ``lm_head`` ones at the end of the backward). NCCL reduces in place (nothing to add on CUDA).

    Enter it inside the tracker, so that the tracker sees the clone, the chunk and the copy as a real run's tracker
    sees gloo's (its work's ``chunk`` and ``copy_`` run on the calling thread, under the tracker's mode). Measured
    (a 2-rank full fine-tune of a 127.5M-parameter checkpoint, fp32): the real run's tracked peak, at the root's
    reduce-scatter, was 294.5 MiB (its two 147.2 MiB gradients) above the estimate without it.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.c10d._reduce_scatter_base_.default:
            outputs, inputs = [args[0]], [args[1]]
        elif func is torch.ops.c10d.reduce_scatter_tensor_coalesced_.default:
            outputs, inputs = list(args[0]), list(args[1])
        else:
            return out
        clones = [t.clone() for t in inputs]  # all-reduced in place by gloo
        for output, clone in zip(outputs, clones, strict=True):
            # the wait: rank 0's chunk, as large as the output (the group may be a sub-mesh: tensor parallelism)
            output.copy_(clone.view(-1)[: output.numel()].view(output.shape))
        return out
