"""Aborting every process group of this process, so that blocked NCCL waits return."""

from __future__ import annotations

__all__ = ["abort_process_groups"]


def abort_process_groups() -> tuple[list[str], list[str]]:
    """Calls ``abort()`` on every process group, newest first.

    On NCCL this aborts the communicators and blocked waits return with an error. On gloo it
    does not wake an op that is already blocked (measured on torch 2.13; see
    ``../shared/NOTES.md``): gloo gives up only at the group's own timeout. The c10d bookkeeping
    is left alone, since the main thread may still hold these groups; ``destroy_process_group()``
    cleans up.

    Returns:
        (names of the groups aborted, ``"name: error"`` for each group whose abort raised).
        Both are empty when no process group is initialized.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [], []
    from torch.distributed import distributed_c10d as c10d

    groups = sorted(dict(c10d._world.pg_names).items(), key=lambda kv: kv[1], reverse=True)
    nccl = None
    try:
        backend = c10d._get_default_group()._get_backend(torch.device("cuda"))
        if c10d.is_nccl_available() and isinstance(backend, c10d.ProcessGroupNCCL):
            nccl = backend
    except (RuntimeError, ValueError, AttributeError):
        nccl = None
    aborted, failed = [], []
    # As torch's _abort_process_group: NCCL aborts inside one group call, so the communicators'
    # aborts cannot deadlock each other (pytorch#119797).
    if nccl is not None:
        nccl._group_start()
    for pg, name in groups:
        try:
            pg.abort()
            aborted.append(name)
        except Exception as exc:  # noqa: BLE001 - one group's failure must not stop the others
            failed.append(f"{name}: {exc}")
    if nccl is not None:
        nccl._group_end()
    return aborted, failed
