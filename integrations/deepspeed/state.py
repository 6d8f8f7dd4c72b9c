"""DeepSpeedState: one rank's own ZeRO state (stages 1, 2 and 3) as named tensors plus JSON, taken
and put back in memory, with no collective and no pickle.

What a rank owns, read in the installed DeepSpeed (0.19.8; the checkpoint code names the same
parts: ``runtime/zero/stage_1_and_2.py`` ``state_dict``/``_load_legacy_checkpoint``,
``runtime/zero/stage3.py`` ``_rigid_state_dict``/``_rigid_load_state_dict``, ``runtime/engine.py``
``_load_checkpoint``):

- ZeRO 1/2: its partition of the fp32 master weights (``single_partition_of_fp32_groups[i]``), the
  optimizer's state for it (``exp_avg``, ``exp_avg_sq``, ``step``), and the module's parameters,
  which every rank holds whole as views of ``bit16_groups_flat[i]``: copying them back needs no
  all-gather.
- ZeRO 3: its partitions of the fp32 master weights (``fp32_partitioned_groups_flat[i]``) and of
  the parameters (``fp16_partitioned_groups_flat[i]``, of which every ``param.ds_tensor`` is a
  view), the optimizer's state, and the whole data of the parameters gathered at capture (the
  persistent ones, below ``stage3_param_persistence_threshold``), so that none is re-gathered.
- Both: the module's buffers (ZeRO partitions parameters only: each rank keeps its own buffers,
  e.g. BatchNorm's running statistics of its own batches), the engine's counters, the LR
  scheduler's ``state_dict``, the optimizer's hyperparameters (the scheduler writes ``lr`` there),
  the loss scaler's numbers.
The RNG states and the data position are the caller's (they are not the engine's).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ncclguard.recovery.snapshots.state import OwnState, StateCodec

__all__ = ["CurrentEngineState", "DeepSpeedState", "EngineHolder", "OwnState"]

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
_JSON_SCALARS = (bool, int, float, str, type(None))


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that are JSON scalars or flat lists/tuples of them (tuples as lists)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, _JSON_SCALARS):
            out[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, _JSON_SCALARS) for v in value):
            out[key] = list(value)
    return out


def _like(current: Any, value: Any) -> Any:
    """``value`` back in the type ``current`` has (JSON turned tuples into lists)."""
    return tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value


class DeepSpeedState(StateCodec):
    """Captures, checks and applies one rank's own state of a DeepSpeed ZeRO 1, 2 or 3 engine.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` with ZeRO stage 1, 2 or 3.
        step_per_micro_batch: ``engine.step()`` is called after every micro-batch, as in DeepSpeed's
            own loop, so ``micro_steps`` tells a window's end. False where the caller sets the
            boundary and steps once per window (Accelerate's ``DeepSpeedEngineWrapper``, the HF
            Trainer): ``micro_steps`` then counts windows, and the state between two steps is a
            window's end (the gradients accumulated so far are not part of the state).

    Raises:
        TypeError: not a DeepSpeed engine.
        ValueError: a setup whose state lives elsewhere (ZeRO stage 0, NVMe offload, hpZ).
    """

    def __init__(self, engine: Any, *, step_per_micro_batch: bool = True) -> None:
        if not callable(getattr(engine, "zero_optimization_stage", None)):
            raise TypeError(f"DeepSpeedState needs a DeepSpeed engine, got {type(engine).__name__}")
        self.engine, self.stage = engine, int(engine.zero_optimization_stage())
        self.step_per_micro_batch = step_per_micro_batch
        opt = engine.optimizer
        needs = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups"}
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"DeepSpeedState supports ZeRO stages 1, 2 and 3, this engine uses stage {self.stage}: set "
                '"zero_optimization": {"stage": 1} (or 2, 3) in the DeepSpeed config'
            )
        if not hasattr(opt, needs.get(self.stage, "fp32_partitioned_groups_flat")):
            raise ValueError(
                f"DeepSpeedState: the engine's optimizer ({type(opt).__name__}) is not DeepSpeed's ZeRO-{self.stage} "
                "optimizer (a bf16/fp16 wrapper or a client ZeRO?); use DeepSpeed's ZeRO optimizer"
            )
        if getattr(opt, "swap_optimizer", False) or getattr(opt, "offload_param_nvme", False):
            raise ValueError(
                "DeepSpeedState: NVMe offload keeps the optimizer's state on disk, out of any snapshot: set the "
                'config\'s "offload_optimizer" and "offload_param" "device" to "none" (CPU offload is not '
                "covered either: docs/stacks/deepspeed.md)"
            )
        if self.stage == 3 and int(engine.zero_hpz_partition_size()) > 1:
            raise ValueError(
                "DeepSpeedState: hpZ (zero_hpz_partition_size > 1) keeps secondary partitions; set it to 1"
            )
        self.opt = opt
        # Read once: the engine keeps its group for life, and a capture must still work after the
        # group died (a failed step: rebuild_world destroyed it, the state is still here).
        group = opt.dp_process_group
        self.dp_world_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)

    # -- the layout -----------------------------------------------------------------------------

    def _groups(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fp32 master partition, low-precision flat) per group: the optimizer's param is the first."""
        if self.stage == 3:
            return list(zip(self.opt.fp32_partitioned_groups_flat, self.opt.fp16_partitioned_groups_flat, strict=True))
        return list(zip(self.opt.single_partition_of_fp32_groups, self.opt.bit16_groups_flat, strict=True))

    def _params(self) -> list[tuple[str, Any]]:
        """The module's parameters by name (ZeRO-3 ones carry ``ds_*`` attributes)."""
        return list(self.engine.module.named_parameters())

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers by name, as ``buffer.<name>``."""
        return {f"buffer.{name}": buf for name, buf in self.engine.module.named_buffers()}

    def _layout(self) -> dict[str, Any]:
        """What must match for a capture to fit: JSON, computed with no collective and no live group."""
        shapes = [[n, list(getattr(p, "ds_shape", p.shape))] for n, p in self._params()]
        return {
            "framework": "deepspeed",
            "zero_stage": self.stage,
            "dp_world_size": self.dp_world_size,
            "dp_rank": self.dp_rank,
            "params": shapes,
            "groups": [[m.numel(), f.numel(), str(m.dtype), str(f.dtype)] for m, f in self._groups()],
        }

    # -- capture --------------------------------------------------------------------------------

    def capture(self) -> OwnState:
        """This rank's own state, the live tensors (the caller copies them); no collective.

        Returns:
            An :class:`OwnState`.

        Raises:
            ValueError: in the middle of a gradient accumulation window (capture at a step boundary).
        """
        eng = self.engine
        if self.step_per_micro_batch and eng.micro_steps % eng.gradient_accumulation_steps() != 0:
            raise ValueError(
                f"DeepSpeedState.capture: micro step {eng.micro_steps} is inside a gradient accumulation window "
                f"of {eng.gradient_accumulation_steps()}; capture after engine.step() closed the window"
            )
        tensors: dict[str, torch.Tensor] = self._buffers()
        if self.stage == 3:
            _zero_padding(self.opt, self._groups(), self.dp_rank)
        for i, (master, flat) in enumerate(self._groups()):
            tensors[f"master.{i}"] = master
            tensors[f"flat.{i}"] = flat
            for key, value in self.opt.optimizer.state.get(master, {}).items():
                if torch.is_tensor(value):
                    tensors[f"optimizer.{i}.{key}"] = value
        if self.stage == 3:
            for name, param in self._params():
                if _gathered(param):  # persistent: whole on every rank, so not re-gathered at apply
                    tensors[f"module.{name}"] = param.data
        scheduler = eng.lr_scheduler
        meta = {
            **self._layout(),
            "counters": {name: int(getattr(eng, name)) for name in COUNTERS},
            "lr_scheduler": None if scheduler is None else _checked_json(scheduler.state_dict(), "lr_scheduler"),
            "param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"}) for g in self.opt.param_groups],
            "optimizer_scalars": [
                _jsonable(dict(self.opt.optimizer.state.get(master, {}))) for master, _ in self._groups()
            ],
            "loss_scaler": _jsonable(vars(self.opt.loss_scaler)),
        }
        return OwnState(tensors, _checked_json(meta, "meta"))

    # -- check ----------------------------------------------------------------------------------

    def check(self, state: OwnState) -> str | None:
        """Why ``state`` cannot be applied to this engine, or None if it can; no collective.

        Args:
            state: a capture (of this rank, of an engine of this shape and world).

        Returns:
            The differences, named (stage, world size, rank, parameters, partitions, tensors), or None.
        """
        if not isinstance(state, OwnState) or not isinstance(state.meta, dict) or not isinstance(state.tensors, dict):
            return f"not an OwnState of a dict of tensors and a dict of JSON values: {type(state).__name__}"
        layout, meta = self._layout(), state.meta
        problems = self._check_meta_form(meta)
        if problems:
            return "; ".join(problems)
        for key in ("framework", "zero_stage", "dp_world_size", "dp_rank"):
            if meta.get(key) != layout[key]:
                problems.append(f"{key}: the capture has {meta.get(key)!r}, this engine {layout[key]!r}")
        ours = {n: list(s) for n, s in layout["params"]}
        theirs = {n: list(s) for n, s in meta["params"]}
        for name in sorted(ours.keys() ^ theirs.keys()):
            problems.append(f"parameter {name}: {'missing from the capture' if name in ours else 'not in this engine'}")
        for name in sorted(ours.keys() & theirs.keys()):
            if ours[name] != theirs[name]:
                problems.append(f"parameter {name}: shape {theirs[name]} in the capture, {ours[name]} here")
        if not problems and meta.get("groups") != layout["groups"]:
            problems.append(
                f"partition layout (numel, dtypes per group): capture {meta.get('groups')}, here {layout['groups']}"
            )
        if (meta.get("lr_scheduler") is None) != (self.engine.lr_scheduler is None):
            problems.append("lr_scheduler: one of the capture and this engine has none")
        if not problems:
            problems += self._check_tensors(state.tensors)
        return "; ".join(problems) or None

    def _check_meta_form(self, meta: dict[str, Any]) -> list[str]:
        """The meta's form, so that ``apply`` cannot fail half-way on it (a replica from a peer)."""
        groups, problems = len(self.opt.param_groups), []
        params = meta.get("params")
        if not (isinstance(params, list) and all(isinstance(p, list) and len(p) == 2 for p in params)):
            problems.append("params: not a list of [name, shape]")
        counters = meta.get("counters")
        if not (isinstance(counters, dict) and set(counters) == set(COUNTERS)):
            problems.append(f"counters: expected {list(COUNTERS)}")
        elif not all(isinstance(v, int) and not isinstance(v, bool) for v in counters.values()):
            problems.append("counters: not all ints")
        for key, want in (("param_groups", groups), ("optimizer_scalars", len(self._groups()))):
            value = meta.get(key)
            if not (isinstance(value, list) and len(value) == want and all(isinstance(v, dict) for v in value)):
                problems.append(f"{key}: expected a list of {want} dicts")
        scaler = meta.get("loss_scaler")
        if not isinstance(scaler, dict) or not set(scaler) <= set(vars(self.opt.loss_scaler)):
            problems.append(
                f"loss_scaler: expected a dict of the loss scaler's fields {sorted(vars(self.opt.loss_scaler))}"
            )
        scheduler = meta.get("lr_scheduler")
        if scheduler is not None and not isinstance(scheduler, dict):
            problems.append("lr_scheduler: not a dict")
        return problems

    def _check_tensors(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The tensors' names, shapes and dtypes against this engine's (the layout already matched)."""
        problems: list[str] = []
        expected: dict[str, torch.Tensor] = self._buffers()
        for n, (master, flat) in enumerate(self._groups()):
            expected[f"master.{n}"], expected[f"flat.{n}"] = master, flat
        params = dict(self._params())
        for name, value in tensors.items():
            if not torch.is_tensor(value):
                problems.append(f"{name}: not a tensor ({type(value).__name__})")
                continue
            if name.startswith("optimizer."):
                owner = expected.get(f"master.{name.split('.')[1]}")
                if owner is None or (value.dim() > 0 and value.shape != owner.shape):
                    problems.append(f"{name}: shape {list(value.shape)} fits no partition here")
                continue
            if name.startswith("module.") and self.stage == 3 and name[7:] in params:
                param = params[name[7:]]
                want: tuple[list[int], torch.dtype] = (list(param.ds_shape), param.dtype)
            elif name in expected:
                want = (list(expected[name].shape), expected[name].dtype)
            else:
                problems.append(f"{name}: no such tensor in this engine's state")
                continue
            if (list(value.shape), value.dtype) != want:
                problems.append(f"{name}: {list(value.shape)} {value.dtype} in the capture, {want[0]} {want[1]} here")
        for name in expected.keys() - tensors.keys():
            problems.append(f"{name}: missing from the capture")
        return problems

    # -- apply ----------------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, state: OwnState) -> None:
        """Puts ``state`` in place, checked first; no collective. Call it at a step boundary.

        Args:
            state: a capture that :meth:`check` accepts.

        Raises:
            ValueError: the capture does not fit this engine (nothing was copied).
        """
        problem = self.check(state)
        if problem is not None:
            raise ValueError(f"DeepSpeedState.apply: the capture does not fit this engine: {problem}")
        tensors, meta = state.tensors, state.meta
        for i, (master, flat) in enumerate(self._groups()):
            master.copy_(tensors[f"master.{i}"])
            flat.copy_(tensors[f"flat.{i}"])
            self._apply_optimizer_state(i, master, tensors, meta["optimizer_scalars"][i])
        for name, buf in self._buffers().items():
            buf.copy_(tensors[name])
        if self.stage == 3:
            self._apply_zero3_params(tensors)
        for group, saved in zip(self.opt.param_groups, meta["param_groups"], strict=True):
            group.update({k: _like(group.get(k), v) for k, v in saved.items()})
        for name, value in meta["loss_scaler"].items():
            setattr(self.opt.loss_scaler, name, _like(getattr(self.opt.loss_scaler, name, None), value))
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(dict(meta["lr_scheduler"]))
        for name in COUNTERS:
            setattr(self.engine, name, int(meta["counters"][name]))

    def _apply_optimizer_state(
        self, i: int, master: torch.Tensor, tensors: dict[str, torch.Tensor], scalars: dict
    ) -> None:
        """The optimizer's state of group ``i`` becomes the capture's: copied in place, made where the
        engine has none yet (torch's Adam makes it at the first step), dropped where the capture has none."""
        inner = self.opt.optimizer
        saved = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"optimizer.{i}.")}
        current = inner.state.setdefault(master, {})
        group: dict[str, Any] = next((g for g in inner.param_groups if any(p is master for p in g["params"])), {})
        on_device = bool(group.get("capturable") or group.get("fused"))
        new: dict[str, Any] = {}
        for key, value in saved.items():
            old = current.get(key)
            if torch.is_tensor(old) and old.shape == value.shape and old.dtype == value.dtype:
                new[key] = old.copy_(value)
            else:  # torch keeps a scalar ``step`` on the CPU unless capturable or fused
                device = master.device if value.dim() > 0 or on_device else torch.device("cpu")
                new[key] = value.detach().to(device, copy=True)
        new.update(scalars)
        if new:
            inner.state[master] = new
        else:
            inner.state.pop(master, None)

    def _apply_zero3_params(self, tensors: dict[str, torch.Tensor]) -> None:
        """Re-points every ``ds_tensor`` at the copied flat partitions (as DeepSpeed's own load does), and
        the gathered parameters: copied when the capture holds them whole, else released (no gather)."""
        for flat, params in zip(self.opt.fp16_partitioned_groups_flat, self.opt.fp16_partitioned_groups, strict=True):
            for partitioned, view in zip(params, self.opt.unflatten(flat, params), strict=True):
                partitioned.data = view.data
        for name, param in self._params():
            if not _gathered(param):
                continue
            whole = tensors.get(f"module.{name}")
            if whole is not None:
                param.data.copy_(whole)
            else:  # the next forward gathers it from the partitions just copied
                param.partition(param_list=[param])


def _padding(params: list[Any], dp_rank: int, numel: int) -> list[tuple[int, int]]:
    """The ranges of a ZeRO-3 group's flat partition that hold no parameter (each parameter's
    partition is padded to an equal size; the last ranks' tails are padding), or [] where the
    layout is not the one read here (then nothing is touched)."""
    ranges, at = [], 0
    for param in params:
        size = param.ds_tensor.numel()
        valid = max(0, min(int(param.ds_numel) - size * dp_rank, size))
        if valid < size:
            ranges.append((at + valid, at + size))
        at += size
    return ranges if at == numel else []


def _zero_padding(opt: Any, groups: list[tuple[torch.Tensor, torch.Tensor]], dp_rank: int) -> None:
    """Zeroes the padding of every ZeRO-3 partition this rank holds (master, low-precision flat,
    optimizer state). DeepSpeed leaves it as ``torch.empty`` made it (``partition_parameters.py``,
    ``_partition_param``: only a parameter's own elements are copied into its partition), so on the
    last rank it can hold NaN; no parameter ever reads it, but a snapshot holding it would be refused
    as NaN at a restore. Zeroed, it is the same in every capture. ZeRO 1/2 pad with zeros already
    (``flatten_dense_tensors_aligned``)."""
    with torch.no_grad():
        for i, (master, flat) in enumerate(groups):
            ranges = _padding(opt.fp16_groups[i], dp_rank, master.numel())
            if not ranges:
                continue
            state = opt.optimizer.state.get(master, {})
            alike = [t for t in (master, flat, *state.values()) if torch.is_tensor(t) and t.numel() == master.numel()]
            for a, b in ranges:
                for t in alike:
                    t.view(-1)[a:b].zero_()


def _gathered(param: torch.nn.Parameter) -> bool:
    """A ZeRO-3 parameter whose whole data is here now (``ds_status`` AVAILABLE)."""
    status = getattr(param, "ds_status", None)
    return status is not None and getattr(status, "name", "") == "AVAILABLE"


def _checked_json(value: Any, what: str) -> Any:
    """``value`` if it survives a JSON round trip unchanged; else a ValueError naming ``what``."""
    try:
        back = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"DeepSpeedState.capture: {what} is not JSON ({exc}); only JSON values are kept") from exc
    if back != value:
        raise ValueError(f"DeepSpeedState.capture: {what} changes in JSON (tuples? non-string keys?): {value!r}")
    return back


class EngineHolder(Protocol):
    """What holds the engine a stepper trains with now: its :class:`DeepSpeedState` (None before one is built)."""

    state: DeepSpeedState | None


class CurrentEngineState(StateCodec):
    """The snapshots' view of whichever engine ``holder`` holds now: a rebuild makes a new engine,
    and the snapshots keep asking the holder, never a stale engine.

    Args:
        holder: the stepper (or the part of one) whose ``state`` is the current engine's.
        missing: why no engine is there yet, for the error.
    """

    def __init__(self, holder: EngineHolder, missing: str = "no DeepSpeed engine is built yet") -> None:
        self.holder, self.missing = holder, missing

    def current(self) -> DeepSpeedState:
        """The current engine's :class:`DeepSpeedState`.

        Raises:
            ValueError: no engine is built yet.
        """
        if self.holder.state is None:
            raise ValueError(self.missing)
        return self.holder.state

    def capture(self) -> OwnState:
        return self.current().capture()

    def check(self, state: OwnState) -> str | None:
        return self.current().check(state)

    def apply(self, state: OwnState) -> None:
        self.current().apply(state)
