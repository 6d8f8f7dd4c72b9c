"""Lightning's ``ModelParallelStrategy`` (FSDP2) under ``NcclGuardCallback(recover=True)``.

Lightning 2.6's FSDP2 path: the ``LightningModule`` shards its own submodules with ``fully_shard`` in
``configure_model``, on the strategy's device mesh (``self.device_mesh["data_parallel"]``), built by
``ModelParallelStrategy.setup_environment`` (``lightning/pytorch/strategies/model_parallel.py``, through
``lightning/fabric/strategies/model_parallel.py`` ``_setup_device_mesh``: ``init_device_mesh`` on the
root device's type, so ``"cpu"`` with gloo here). After a rebuild the sharded modules hold the
abandoned groups; this module makes them again on the new world, the way the user made them:

- when the callback is set up (before ``configure_model``), each direct child of the LightningModule
  is copied to the meta device: the *skeletons* (no memory);
- after a rebuild: the device mesh is made again on the new world, each child that holds shards is
  replaced by a copy of its skeleton, ``configure_model`` runs again (so it shards the copies on the
  new mesh, with the user's own layout and policies), the copies get real storage, and each rank
  copies its own shards of the parameters (the DTensors the optimizer holds, whatever a failed step
  left registered on the modules) and its buffers into them; the optimizers are pointed at the new
  parameters and their sharded state at the new mesh. No collective runs on the old world.

What makes it exact: the rebuilt world has the same members in the same order (a rank killed comes
back in its place; a shrink is refused), so rank ``r`` of the new world held shard ``r``.
``configure_model`` must shard what it finds (Lightning asks it to be idempotent: guard on the modules
being sharded already, e.g. ``isinstance(self.net, FSDPModule)``, never on a flag). This is checked when
fit starts, before any step, by a dry run on the meta device.

A restarted rank (``heal=True``) builds its strategy on the stand-in world of one
(:func:`ncclguard.toolkit.stand_in_active`), where Lightning's mesh of the launch's world size
cannot be made ("Mesh should not be bigger than default world size"): while the stand-in is in force,
:func:`install_stand_in_mesh` makes it a mesh of one with the same dimension names. The restarted
rank's model is then whole (a mesh of one) until it joins; the join shards it on the real world before
its snapshot is restored.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ncclguard.recovery.fsdp2 import repoint_optimizer
from ncclguard.toolkit import log, stand_in_active

__all__ = ["ShardedLightning", "check_model_parallel", "install_stand_in_mesh"]


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def check_model_parallel(strategy: Any, allow_shrink: bool) -> None:
    """Refuses a ``ModelParallelStrategy`` that a rebuilt world cannot shard again, before any step.

    Args:
        strategy: the trainer's ``ModelParallelStrategy``, its environment set up.
        allow_shrink: the callback's option.

    Raises:
        ValueError: tensor parallelism (``tensor_parallel_size`` > 1), or ``allow_shrink=True``.
    """
    tp = getattr(strategy, "_tensor_parallel_size", None)
    if tp != 1:
        raise ValueError(
            f"NcclGuardCallback(recover=True) shards the model again after a rebuild with FSDP2 only; this "
            f"ModelParallelStrategy has tensor_parallel_size={tp!r} (tensor parallelism is not re-applied). Use "
            "ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1), or recover=False"
        )
    if allow_shrink:
        raise ValueError(
            "allow_shrink=True cannot go with ModelParallelStrategy (FSDP2): a rank left out takes its shards "
            "with it (FSDP2 keeps no replica); use allow_shrink=False (with heal=True a killed rank comes back "
            "from its buddy's snapshot)"
        )


class ShardedLightning:
    """The skeletons of a LightningModule's children and how to shard them again (see the module doc).

    Args:
        trainer: the trainer, its strategy a ``ModelParallelStrategy``.
        pl_module: the LightningModule, not sharded yet (the callback's ``setup``).
    """

    def __init__(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self.trainer = trainer
        # deepcopy then meta: the structure, no memory; children made on meta already stay there.
        self.skeletons = {name: copy.deepcopy(child).to("meta") for name, child in pl_module.named_children()}
        self.params: dict[str, torch.Tensor] = {}  # the live parameters by name (the shards the optimizer holds)

    @property
    def module(self) -> Any:
        """The LightningModule (typed loosely: Lightning's ``_device_mesh`` and ``_modules`` are set on it)."""
        return self.trainer.strategy.lightning_module

    def check(self) -> None:
        """Checks, when fit starts, that a rebuilt world can shard the module again: called after
        ``configure_model`` and the strategy's setup, before any step.

        Raises:
            ValueError: the LightningModule itself is sharded, a sharded module was made in
                ``configure_model`` (no skeleton of it), or ``configure_model`` did not shard fresh
                copies as it sharded the modules (a dry run on the meta device).
        """
        from torch.distributed.fsdp import FSDPModule

        lm = self.module
        if isinstance(lm, FSDPModule):
            raise ValueError(
                "NcclGuardCallback(recover=True): configure_model applied fully_shard to the LightningModule "
                "itself, which cannot be sharded again in place after a rebuild; shard its submodules (each "
                "layer, then the model they are in), as Lightning's FSDP2 examples do"
            )
        live: dict[str, torch.Tensor] = dict(lm.named_parameters())
        made_late = sorted({n.split(".")[0] for n, p in live.items() if _is_dtensor(p)} - set(self.skeletons))
        if made_late:
            raise ValueError(
                f"NcclGuardCallback(recover=True): the sharded module(s) {made_late} did not exist when fit set "
                "up (made in setup() or configure_model): a rebuilt world shards a copy of each module made "
                "before; create them in __init__ (on the meta device, with trainer.init_module(empty_init=True), "
                "if they are big) and only shard them in configure_model"
            )
        fresh = self._sharded_copies()
        problem = _differ(live, {f"{n}.{k}": p for n, m in fresh.items() for k, p in m.named_parameters()})
        if problem:
            raise ValueError(
                "NcclGuardCallback(recover=True): configure_model, run again on fresh unsharded copies of the "
                f"sharded modules (what a rebuilt world does), did not shard them as before: {problem}. Make it "
                "shard what it finds: guard on the modules being sharded already (isinstance(self.net, "
                "FSDPModule)), not on a flag"
            )
        self.params = live

    def _holding_shards(self) -> list[str]:
        return [n for n, c in self.module.named_children() if n in self.skeletons and _has_dtensor(c)]

    def _sharded_copies(self) -> dict[str, torch.nn.Module]:
        """Copies of the skeletons of the children that hold shards, sharded by ``configure_model`` on
        the strategy's current mesh (on the meta device: no storage yet)."""
        from lightning.pytorch.trainer import call

        lm, names = self.module, self._holding_shards()
        olds = {n: lm._modules[n] for n in names}
        fresh = {n: copy.deepcopy(self.skeletons[n]) for n in names}
        try:
            lm._modules.update(fresh)
            call._call_configure_model(self.trainer)  # Lightning's own call, with its init contexts
        finally:
            lm._modules.update(olds)
        return fresh

    def reshard(self, copy_shards: bool) -> None:
        """Makes the mesh and the sharded children again on the current world (see the module doc).

        Args:
            copy_shards: copy this rank's shards and buffers from the old children (a survivor);
                False on a restarted rank, whose state comes from its buddy's snapshot next.

        Raises:
            RuntimeError: a shard's shape differs in the new layout (the world is not the one the
                shards were cut for).
        """
        from lightning.fabric.strategies.model_parallel import _setup_device_mesh

        strategy, lm = self.trainer.strategy, self.module
        mesh = _setup_device_mesh(
            strategy._data_parallel_size, strategy._tensor_parallel_size, strategy.world_size, strategy.root_device
        )
        strategy._device_mesh = lm._device_mesh = mesh
        fresh = self._sharded_copies()
        old_children = {n: lm._modules[n] for n in fresh}
        for child in fresh.values():
            child.to_empty(device=strategy.root_device)
        lm._modules.update(fresh)
        new: dict[str, torch.Tensor] = dict(lm.named_parameters())
        if copy_shards:
            _copy_into(self.params, new, old_children, fresh)
        for optimizer in self.trainer.optimizers:
            repoint_optimizer(optimizer, {id(p): new[n] for n, p in self.params.items() if n in new})
        self.params = new
        log.info("NcclGuardCallback: %d module(s) sharded again on the new world (%s)", len(fresh), mesh)


def _has_dtensor(module: torch.nn.Module) -> bool:
    return any(_is_dtensor(p) for p in module.parameters())


def _differ(live: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor]) -> str | None:
    """Why the fresh copies' parameters are not laid out as the live ones, or None."""
    children = {n.split(".")[0] for n in fresh}
    wanted = {n: p for n, p in live.items() if n.split(".")[0] in children}
    if set(wanted) != set(fresh):
        odd = sorted(set(wanted) ^ set(fresh))[:3]
        return f"the copies' parameters are not the module's (differing: {odd})"
    for name, p in fresh.items():
        want = wanted[name]
        if _is_dtensor(p) != _is_dtensor(want):
            return f"{name} is {'sharded' if _is_dtensor(want) else 'a plain tensor'} live, not in the copy"
        if not _is_dtensor(p):
            continue
        got_layout = (tuple(p.shape), tuple(p.placements), tuple(_local(p).shape))  # type: ignore[attr-defined]
        want_layout = (tuple(want.shape), tuple(want.placements), tuple(_local(want).shape))  # type: ignore[attr-defined]
        if got_layout != want_layout:
            return f"{name} is (shape, placements, shard) {got_layout} in the copy, {want_layout} live"
    return None


def _copy_into(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    old_children: Mapping[str, torch.nn.Module],
    fresh: Mapping[str, torch.nn.Module],
) -> None:
    """This rank's shards (and the children's buffers) from the old parameters into the new ones."""
    with torch.no_grad():
        for child in fresh:
            for name, p in new.items():
                if not name.startswith(child + "."):
                    continue
                src, dst = _local(old[name]), _local(p)
                if src.shape != dst.shape:
                    raise RuntimeError(f"the shard of {name} is {tuple(src.shape)} here, {tuple(dst.shape)} resharded")
                dst.copy_(src)
            for b_new, b_old in zip(fresh[child].buffers(), old_children[child].buffers(), strict=True):
                b_new.copy_(b_old)


_MESH_PATCH = "__ncclguard_stand_in_mesh__"


def install_stand_in_mesh() -> bool:
    """In a restarted process, makes Lightning's ``ModelParallelStrategy`` build a mesh of one while the
    stand-in world is in force (see the module doc); elsewhere the mesh is Lightning's own.

    Returns:
        True when the patch is in place (now or before).
    """
    from lightning.pytorch.strategies import model_parallel

    original = model_parallel._setup_device_mesh
    if getattr(original, _MESH_PATCH, False):
        return True

    def setup_device_mesh(data_parallel_size: int, tensor_parallel_size: int, world_size: int, device: Any) -> Any:
        if stand_in_active():
            # The same dimension names, so configure_model's self.device_mesh["data_parallel"] works.
            return original(1, 1, 1, device)
        return original(data_parallel_size, tensor_parallel_size, world_size, device)

    setattr(setup_device_mesh, _MESH_PATCH, True)
    model_parallel._setup_device_mesh = setup_device_mesh
    return True
