"""A rank's own training state as named tensors and JSON: what a snapshot holds.

:class:`OwnState` is the one shape every framework's state takes here: ``tensors`` (this rank's
own tensors, by a stable name: its shards under FSDP2, its partitions under DeepSpeed ZeRO) and
``meta`` (JSON values: optimizer hyperparameters, scalars, the layout the tensors were taken in).
A :class:`StateCodec` captures it from a live model, says why a captured state cannot go into a
model (:meth:`StateCodec.check`), and puts it in place (:meth:`StateCodec.apply`).

:class:`ModuleState` is the codec of a ``torch.nn.Module`` and its optimizer, plain or sharded by
FSDP2: a DTensor parameter is captured as its local shard, with its global shape and placements
in ``meta``, so that a state taken on rank 1 of a world of 4 is refused by rank 2, or by a world
of 3, before anything is copied.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.recovery.state_json import from_json, to_json

__all__ = ["ModuleState", "OwnState", "StateCodec", "layout"]


@dataclass
class OwnState:
    """One rank's own training state.

    Attributes:
        tensors: its tensors by stable name, in a fixed order (live tensors when captured, copies
            in a snapshot).
        meta: JSON values (None, bool, int, float, str, lists, dicts with str keys).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


class StateCodec(abc.ABC):
    """Takes a rank's own state out of a live model and puts one back."""

    @abc.abstractmethod
    def capture(self) -> OwnState:
        """The live state (tensors not copied: the snapshot copies them). Runs no collective."""

    @abc.abstractmethod
    def check(self, state: OwnState) -> str | None:
        """Why ``state`` cannot go into this model (names, shapes, dtypes, layout, world), or None."""

    @abc.abstractmethod
    def apply(self, state: OwnState) -> None:
        """Puts ``state`` in place (call :meth:`check` first). Runs no collective."""


def layout() -> dict[str, int]:
    """This rank's place: a state taken here goes back to the same rank of a world of this size."""
    if dist.is_available() and dist.is_initialized():
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    return {"rank": 0, "world_size": 1}


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    dt = _dtensor_class()
    return t.to_local() if dt is not None and isinstance(t, dt) else t  # type: ignore[attr-defined]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _describe(t: torch.Tensor) -> dict[str, Any]:
    """What a tensor must look like to take this state: local shape and dtype, and for a DTensor
    its whole shape and placements (the shard layout)."""
    local = _local(t)
    out: dict[str, Any] = {"dtype": _dtype_name(local), "shape": list(local.shape)}
    if local is not t:
        out["global"] = list(t.shape)
        out["placements"] = [str(p) for p in t.placements]  # type: ignore[attr-defined]
    return out


class ModuleState(StateCodec):
    """The codec of a module and its optimizer (plain tensors, or DTensors of FSDP2).

    Args:
        module: a callable returning the current module (FSDP2 makes a new one after a rebuild).
        optimizer: a callable returning its optimizer, or None for none.
        extra: a callable returning more JSON state to carry (a scheduler's ``state_dict``), and
            ``restore_extra`` puts it back; both optional.
    """

    def __init__(
        self,
        module: Any,
        optimizer: Any = None,
        extra: Any = None,
        restore_extra: Any = None,
    ) -> None:
        self._module, self._optimizer = module, optimizer
        self._extra, self._restore_extra = extra, restore_extra

    # ------------------------------------------------------------------------------ capture

    def capture(self) -> OwnState:
        """This rank's parameters (local shards), buffers and optimizer state; see the class doc."""
        module: torch.nn.Module = self._module()
        state = OwnState(meta={"layout": layout(), "module": {}})
        for name, p in module.named_parameters():
            state.tensors["p:" + name] = _local(p.detach())
            state.meta["module"]["p:" + name] = _describe(p)
        for name, b in module.named_buffers():
            state.tensors["b:" + name] = b.detach()
            state.meta["module"]["b:" + name] = _describe(b)
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            sd = optimizer.state_dict()
            found: list[torch.Tensor] = []
            # DTensors go as their local shard; apply() makes them again on the parameter's mesh.
            plain = {
                pid: {k: (_local(v) if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                for pid, s in sd["state"].items()
            }
            state.meta["optimizer"] = to_json({"state": plain, "param_groups": sd["param_groups"]}, found, "opt")
            for i, t in enumerate(found):
                state.tensors[f"o:{i}"] = t.detach()
        if self._extra is not None:
            found = []
            state.meta["extra"] = to_json(self._extra(), found, "extra")
            for i, t in enumerate(found):
                state.tensors[f"x:{i}"] = t.detach()
        return state

    # ------------------------------------------------------------------------------ check

    def check(self, state: OwnState) -> str | None:
        """Why ``state`` cannot go into this module and optimizer on this rank, or None."""
        here = layout()
        there = state.meta.get("layout")
        if there != here:
            return f"the snapshot was taken by rank {_get(there, 'rank')} of a world of {_get(there, 'world_size')}; this is rank {here['rank']} of {here['world_size']}"
        module: torch.nn.Module = self._module()
        mine = {
            **{"p:" + n: _describe(p) for n, p in module.named_parameters()},
            **{"b:" + n: _describe(b) for n, b in module.named_buffers()},
        }
        theirs = state.meta.get("module", {})
        if list(theirs) != list(mine):
            extra, missing = sorted(set(theirs) - set(mine))[:3], sorted(set(mine) - set(theirs))[:3]
            return f"the snapshot's tensors do not name this module's (only in the snapshot: {extra or 'none'}; only here: {missing or 'none'})"
        for name, want in mine.items():
            if theirs[name] != want:
                return f"{name[2:]} is {_shown(theirs[name])} in the snapshot and {_shown(want)} here"
            t = state.tensors.get(name)
            if t is None or [_dtype_name(t), list(t.shape)] != [want["dtype"], want["shape"]]:
                return f"{name[2:]}: the snapshot's data does not match its own description"
        optimizer = self._optimizer() if self._optimizer is not None else None
        if (optimizer is None) != ("optimizer" not in state.meta):
            return "the snapshot and this rank disagree on whether there is an optimizer"
        if optimizer is not None:
            try:
                groups = from_json(state.meta["optimizer"], self._opt_tensors(state))["param_groups"]
                sizes = [len(g["params"]) for g in groups]
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                return f"the snapshot's optimizer state cannot be read ({exc})"
            if sizes != [len(g["params"]) for g in optimizer.param_groups]:
                return f"the snapshot's optimizer has parameter groups of sizes {sizes}, this one {[len(g['params']) for g in optimizer.param_groups]}"
        return None

    # ------------------------------------------------------------------------------ apply

    def apply(self, state: OwnState) -> None:
        """Copies the parameters' shards and the buffers in, and loads the optimizer's state with
        each DTensor made again on its parameter's mesh."""
        module: torch.nn.Module = self._module()
        with torch.no_grad():
            for name, p in module.named_parameters():
                _local(p).copy_(state.tensors["p:" + name])
            for name, b in module.named_buffers():
                b.copy_(state.tensors["b:" + name])
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            sd = from_json(state.meta["optimizer"], self._opt_tensors(state))
            params = [p for g in optimizer.param_groups for p in g["params"]]
            sd["state"] = {
                int(pid): {
                    k: _like(params[int(pid)], v) if isinstance(v, torch.Tensor) and k != "step" else _copy(v)
                    for k, v in s.items()
                }
                for pid, s in sd["state"].items()
            }
            optimizer.load_state_dict(sd)
        if self._restore_extra is not None and "extra" in state.meta:
            xs = [state.tensors[k] for k in state.tensors if k.startswith("x:")]
            self._restore_extra(from_json(state.meta["extra"], xs))

    @staticmethod
    def _opt_tensors(state: OwnState) -> list[torch.Tensor]:
        return [state.tensors[k] for k in state.tensors if k.startswith("o:")]


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a shard) as the optimizer state of ``param``: a DTensor on its mesh if it is one."""
    dt = _dtensor_class()
    if dt is not None and isinstance(param, dt):
        return dt.from_local(  # type: ignore[attr-defined]
            local.clone(),
            param.device_mesh,  # type: ignore[attr-defined]
            param.placements,  # type: ignore[attr-defined]
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return local.clone()


def _get(d: Any, key: str) -> Any:
    return d.get(key) if isinstance(d, dict) else None


def _shown(d: dict[str, Any]) -> str:
    text = f"{d.get('dtype')}{d.get('shape')}"
    if "global" in d:
        text += f" (a shard of {d['global']}, {d.get('placements')})"
    return text
