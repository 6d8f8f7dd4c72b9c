"""FSDP2 under RecoveringStep: the sharded model made again on the rebuilt world, from the shards
each rank still holds.

A failed step never reached ``optimizer.step()``, so every rank's shards of the parameters and of
the optimizer's state are those from before the step. When the rebuilt world has the same members
in the same order, rank ``r`` of the new world held shard ``r`` in the old one: nothing needs to
travel. The module is made again from a skeleton on the meta device, sharded on a mesh of the new
world by the same ``shard`` function, and each rank copies its own shards into it; the optimizer's
parameters and state are pointed at the new shards. No collective runs on the old world, whose
communicator may be dead.

A rank that is left out takes its shards with it: FSDP2 keeps no replica, so a world that shrank
cannot be resharded from what is left (HSDP's replicas could; not built). ``allow_shrink=True`` is
refused with this wrap.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.world import current_world

__all__ = ["FSDP2", "repoint_optimizer"]

ShardFn = Callable[[torch.nn.Module, Any], Any]


def _shard_root(module: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)


class FSDP2:
    """The ``wrap`` of :class:`~ncclguard.RecoveringStep` for FSDP2 (``fully_shard``) models.

    ``RecoveringStep(module, optimizer, wrap=ncclguard.FSDP2(shard))`` with the module unsharded
    and the optimizer built on its parameters, not stepped yet: the wrap shards the module and
    points the optimizer at the shards (FSDP2 replaces each parameter). After a rebuild the model
    is a new object: use ``stepper.model``, never a reference kept from before.

    Args:
        shard: applies ``fully_shard`` to the module on the mesh it is given (each layer, then the
            root, as you would); default: ``fully_shard(module, mesh=mesh)`` on the root only.
            It runs again, on a skeleton of the module, after every rebuild.
        device_type: the mesh's device type; default ``"cuda"`` on NCCL, else ``"cpu"``.

    Raises:
        TypeError: ``shard`` is not callable or ``device_type`` not a str.
    """

    refuses_shrink = True  # RecoveringStep reads it: shards of a rank left out are lost

    def __init__(self, shard: ShardFn | None = None, *, device_type: str | None = None) -> None:
        if shard is not None and not callable(shard):
            raise TypeError(f"FSDP2's shard must apply fully_shard to (module, mesh), got {type(shard).__name__}")
        if device_type is not None and not isinstance(device_type, str):
            raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
        self._shard: ShardFn = shard if shard is not None else _shard_root
        self._device_type = device_type
        self._skeleton: torch.nn.Module | None = None

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        kind = self._device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        # A 1-D mesh of the whole world: torch gives it the default group, so no group is created.
        return init_device_mesh(kind, (dist.get_world_size(),))

    def first(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """Shards ``module`` in place on a mesh of the current world and keeps its skeleton.

        Args:
            module: the unsharded module (its parameters plain tensors).
            optimizer: built on the unsharded parameters and not stepped yet; pointed at the shards
                (FSDP2 replaces each parameter by a sharded one).

        Returns:
            The module, sharded (FSDP2 shards in place).

        Raises:
            RuntimeError: no process group is initialized, the module is already sharded, or the
                optimizer holds state or parameters that are not the module's.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FSDP2 needs an initialized process group; call init_process_group first")
        if any(_is_dtensor(p) for p in module.parameters()):
            raise RuntimeError(
                "FSDP2 was given a module that is already sharded; give RecoveringStep the unsharded "
                "module and let the wrap shard it (it keeps a skeleton to shard again after a rebuild)"
            )
        plain = list(module.named_parameters())
        mine = {id(p) for _, p in plain}
        if optimizer.state or any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                "FSDP2: build the optimizer on the unsharded module's parameters and do not step it "
                "before RecoveringStep (the wrap points it at the shards)"
            )
        # The skeleton holds the structure and no memory: it is sharded again after each rebuild.
        self._skeleton = copy.deepcopy(module).to("meta")
        mesh = self._mesh()
        self._shard(module, mesh)
        sharded = list(module.named_parameters())
        repoint_optimizer(optimizer, {id(p_old): p_new for (_, p_old), (_, p_new) in zip(plain, sharded, strict=True)})
        return module

    def again(self, old: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The module made again on the rebuilt world, holding this rank's shards of ``old``.

        Args:
            old: the sharded module of the old world (its buffers already put back).
            optimizer: its optimizer; its parameters and state are pointed at the new shards.

        Returns:
            The new sharded module.

        Raises:
            RuntimeError: the new world is not the old one renumbered as it was (a rank left out, a
                rank moved): this rank's shards are not the ones it needs.
        """
        assert self._skeleton is not None, "FSDP2.again before the first wrap"
        olds: list[tuple[str, Any]] = list(old.named_parameters())  # DTensor parameters
        mesh_size = olds[0][1].device_mesh.size() if olds and _is_dtensor(olds[0][1]) else None
        world = current_world()
        moved = {k: v for k, v in world.rank_map.items() if k != v}
        if mesh_size != dist.get_world_size() or moved or world.left_out:
            raise RuntimeError(
                f"FSDP2 cannot reshard: the rebuilt world has {dist.get_world_size()} rank(s) where the shards "
                f"were spread over {mesh_size}, ranks moved {moved or 'none'}, left out {list(world.left_out) or 'none'}; "
                "FSDP2 keeps no replica of a lost rank's shards"
            )
        new = copy.deepcopy(self._skeleton)
        mesh = self._mesh()
        self._shard(new, mesh)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
        )
        new.to_empty(device=device)
        news: list[tuple[str, Any]] = list(new.named_parameters())
        if [n for n, _ in olds] != [n for n, _ in news]:
            raise RuntimeError(
                "FSDP2: the resharded module's parameters differ from the old one's; is shard() deterministic?"
            )
        with torch.no_grad():
            for (name, p_old), (_, p_new) in zip(olds, news, strict=True):
                src, dst = p_old.to_local(), p_new.to_local()
                if src.shape != dst.shape:
                    raise RuntimeError(
                        f"FSDP2: shard of {name} is {tuple(src.shape)} here, {tuple(dst.shape)} resharded"
                    )
                dst.copy_(src)
            for b_new, b_old in zip(new.buffers(), old.buffers(), strict=True):
                b_new.copy_(b_old)
        repoint_optimizer(optimizer, {id(p_old): p_new for (_, p_old), (_, p_new) in zip(olds, news, strict=True)})
        log.info("FSDP2: resharded %d parameter(s) on world generation %d", len(news), world.generation)
        return new


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def repoint_optimizer(optimizer: torch.optim.Optimizer, new_of: Mapping[int, torch.Tensor]) -> None:
    """Points ``optimizer`` at new parameters, its sharded state at each new parameter's mesh.

    Args:
        optimizer: its parameters and state are replaced in place (the object stays: schedulers and
            frameworks keep their references).
        new_of: the new parameter of each old one, by the old one's ``id``.

    Raises:
        KeyError: a parameter of the optimizer has no new one.
    """
    from torch.distributed.tensor import DTensor

    def moved(value: Any, param: torch.Tensor) -> Any:
        if isinstance(value, DTensor) and isinstance(param, DTensor):
            return DTensor.from_local(
                value.to_local(),
                param.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        return value

    state: defaultdict[Any, Any] = defaultdict(dict)
    for p_old, held in optimizer.state.items():
        p_new = new_of[id(p_old)]
        state[p_new] = {k: moved(v, p_new) for k, v in held.items()}
    for group in optimizer.param_groups:
        group["params"] = [new_of[id(p)] for p in group["params"]]
    optimizer.state = state
