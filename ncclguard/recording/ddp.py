"""DDP's gradient all-reduces in the flight recorder, through a communication hook.

DDP's reducer issues its bucket all-reduces from C++, where ``instrument()`` does not see them: a
loop that only calls DDP left no record of its collectives, so a hang showed no op in flight and
the straggler windows had no wait to weigh. :func:`record_ddp` registers a comm hook that opens a
record when DDP hands a bucket over and finishes it when the bucket's future completes (in the
backend's thread), around torch's ``allreduce_hook`` (divide by the group's size, then ``all_reduce(SUM)``) or around a
hook of yours. DDP's built-in path, which a registered hook replaces, multiplies by ``1/size``
while it copies gradients into the bucket (``reducer.cpp``), so a run with the hook can differ from
one without it in the last bit; two runs with it are bit-equal.

A record's time runs from the moment the bucket was ready on this rank to the moment the
all-reduce completed here: the wait for the last peer to get its bucket ready, and the transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._naming import dtype_name
from ncclguard.recording.flight import recorder

__all__ = ["DDP_SITE", "record_ddp"]

DDP_SITE = "DDP bucket"  # the records' call site: "DDP bucket <index>"

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def record_ddp(model: torch.nn.Module, hook: Hook | None = None, state: Any = None) -> None:
    """Records each of ``model``'s bucket all-reduces in the flight recorder.

    Call it once, after wrapping the model in ``DistributedDataParallel`` and before its first
    backward (DDP takes one comm hook, and only then).

    Args:
        model: the ``DistributedDataParallel`` model.
        hook: your comm hook, if the model needs one (it is timed as it is); default DDP's
            ``allreduce_hook``.
        state: your hook's state; default the model's process group.

    Raises:
        TypeError: ``model`` is not a DistributedDataParallel, or ``hook`` is not callable.
        RuntimeError: from DDP: a hook is registered already, or a backward ran already.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"record_ddp needs a DistributedDataParallel model, got {type(model).__name__}")
    if hook is not None and not callable(hook):
        raise TypeError(f"hook must be a DDP comm hook (state, bucket) -> Future, got {type(hook).__name__}")
    inner: Hook = hook if hook is not None else allreduce_hook
    group = model.process_group
    name = compat.group_names().get(group, "?")
    op = "all_reduce(SUM)" if hook is None else f"ddp_comm_hook({getattr(hook, '__name__', type(hook).__name__)})"

    def recorded(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        rec = recorder.start(
            op, name, buffer.numel(), dtype_name(buffer.dtype), site=f"{DDP_SITE} {bucket.index()}", async_op=True
        )
        try:
            fut = inner(hook_state, bucket)
        except BaseException as exc:
            recorder.finish(rec, exc)
            raise
        recorder.hand_off(rec)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                value = f.value()
            except BaseException as exc:
                recorder.finish(rec, exc)
                raise
            recorder.finish(rec)
            return value

        return fut.then(done)

    # DDP checks the annotations as objects; this module's are strings (PEP 563).
    recorded.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    model.register_comm_hook(group if state is None else state, recorded)
