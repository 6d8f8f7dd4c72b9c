"""The DeepSpeed part of ``guard_trainer(recover=True)``: the HF Trainer on DeepSpeed ZeRO 1, 2 and 3.

Under DeepSpeed the Trainer's ``training_step`` applies the step itself: ``accelerator.backward(loss)``
is Accelerate's ``DeepSpeedEngineWrapper.backward`` (accelerate/utils/deepspeed.py), which calls
``engine.backward(loss)`` and then, on the step's last micro-batch, ``engine.step()``; the Trainer's
own ``optimizer.step()`` and ``lr_scheduler.step()`` are no-ops there. So the commit must sit between
the engine's backward and its step: :meth:`DeepSpeedPart.adopt` wraps ``step`` on each engine the
Trainer builds, and while a step's transaction is open the call is held until the commit; it runs
once every rank committed, and never for a step that failed.

A failed step is redone on a new engine, never on the old one: a DeepSpeed engine keeps the groups
of the world it was built in (its clone of the world group, ZeRO's per-parameter
``ds_process_group``; see :mod:`ncclguard.integrations.deepspeed.commit`). After the rebuild every
rank enters ``train()`` again at the step (:class:`~ncclguard.recovery.engine.Reenter`), so the
Trainer builds the engine itself, as it does at the start, from a fresh module of the same
architecture (:func:`fresh_module`; the Trainer's ``model_init`` when it has one) whose state the
script's own module object takes over (:func:`renew_in_place`: the ``model`` a script holds is the
module trained, after a heal as before it), and its resume
path positions the data, the step and the epoch from the state kept in memory. The engine's state
goes into the new engine before any step (:meth:`DeepSpeedPart.adopt`):

- every rank alive (an exception, a stall past the step bound): each rank's own ZeRO state as the
  failed step found it, taken from the old engine (:class:`DeepSpeedState`, no collective);
- a rank killed and restarted (``heal=True``): every rank goes back to the newest snapshot all
  hold (:mod:`ncclguard.recovery.snapshots`), the restarted rank's partitions from its buddy's
  replica, in two halves: the step and the replicas before ``train()`` (the Trainer reads its state
  before it builds the engine), the check and the copy once the engine is built.

In both cases every rank checks what it would put in and all learn who refused before anything is
copied (:func:`~ncclguard.recovery.snapshots.restore.put_back`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from ncclguard.errors import HealFailed
from ncclguard.recovery.engine import Recovery
from ncclguard.recovery.snapshots.restore import Fetched, agree, put_back
from ncclguard.recovery.snapshots.state import OwnState
from ncclguard.recovery.state_json import from_json
from ncclguard.toolkit import log

from ..deepspeed.commit import number_parameters_afresh, release_deepspeed_groups
from ..deepspeed.state import CurrentEngineState, DeepSpeedState

__all__ = ["DeepSpeedPart", "batch_for_world", "deepspeed_refusal", "fresh_module", "renew_in_place"]

_TRAINER = "trainer_state"  # the Trainer's state in a snapshot's meta (JSON text)


def deepspeed_refusal(trainer: Any, allow_shrink: bool, on_nonfinite: str) -> str | None:
    """Why ``guard_trainer(recover=True)`` cannot recover this DeepSpeed Trainer, or None; read from
    the DeepSpeed config and the Trainer before any step (the engine is built in ``train()``).

    Args:
        trainer: a ``transformers.Trainer`` with ``is_deepspeed_enabled``.
        allow_shrink: the ``allow_shrink`` asked for.
        on_nonfinite: the ``on_nonfinite`` asked for.

    Returns:
        One sentence naming what cannot be recovered and what to use instead, or None.
    """
    from transformers import PreTrainedModel

    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    zero = config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        return (
            f"recover=True with DeepSpeed keeps each rank's ZeRO partitions, and this config has ZeRO stage {stage!r}: "
            'set "zero_optimization": {"stage": 1} (or 2, 3), or train without deepspeed= (DDP, which recover=True redoes too)'
        )
    nvme = [k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device") == "nvme"]
    if nvme:
        return f"recover=True keeps the ZeRO state in memory; {', '.join(nvme)} to NVMe keeps it on disk: offload to cpu or none"
    if int(zero.get("zero_hpz_partition_size", 1) or 1) > 1:
        return "recover=True does not keep hpZ's secondary partitions: set zero_hpz_partition_size to 1"
    if int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1) > 1:
        return "recover=True with DeepSpeed covers data parallelism only; this config has autotp_size > 1"
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and getattr(pc, "sp_enabled", False):
        return "recover=True with DeepSpeed covers data parallelism only; this Trainer uses sequence parallelism"
    if on_nonfinite == "skip":
        return (
            "on_nonfinite='skip' cannot drop a batch under DeepSpeed: ZeRO keeps the refused gradients in its own "
            "partitions, and the Trainer's loop has no step to skip them in. Use on_nonfinite='redo' (the step runs "
            "again on a new engine) or 'raise'"
        )
    if allow_shrink:
        return (
            "allow_shrink=True cannot go on with DeepSpeed ZeRO: each rank's partitions are laid out for the world "
            "size they were made in, and a smaller world cannot take them. Leave allow_shrink off (a lost rank is "
            "restarted and healed with heal=True under ncclguard run --ncclguard-restarts), or restart from a "
            "checkpoint with DeepSpeed's universal checkpointing"
        )
    if trainer.model_init is None and not isinstance(trainer.model, PreTrainedModel):
        return (
            "recover=True with DeepSpeed builds the engine again on a new world from a fresh module, which ncclguard "
            f"makes from a PreTrainedModel's config; this model is a {type(trainer.model).__name__}: pass "
            "Trainer(model_init=...) that builds it"
        )
    return None


def fresh_module(model: Any) -> torch.nn.Module:
    """A new module of ``model``'s architecture, built as Transformers builds one from a config
    (``_from_config``: under ZeRO-3 it is partitioned as it is made, on the current world); its
    random draws do not move the generators. Its weights are overwritten by the state put in.

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"a fresh module is made from a PreTrainedModel's config, not a {type(model).__name__}")
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        return type(model)._from_config(model.config)


def renew_in_place(model: Any) -> torch.nn.Module:
    """``model`` made anew in place: a :func:`fresh_module` whose state every module object of
    ``model`` takes over (its parameters, buffers and hooks, module by module), so that the object
    the script holds (``model`` passed to the Trainer, ``model.bert``, ...) is the module the new
    engine trains. The old parameters, bound to the old engine and its world, are dropped; each new
    one keeps the old one's ``requires_grad`` (a frozen layer stays frozen).

    Returns:
        ``model`` itself; the fresh module where its tree is not the fresh one's (modules added or
        removed after it was built), with a warning that the script's object is no longer trained.

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``.
    """
    fresh = fresh_module(model)
    old = list(model.named_modules(remove_duplicate=False))
    new = list(fresh.named_modules(remove_duplicate=False))
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if [n for n, _ in old] != [n for n, _ in new] or [type(m) for _, m in old] != [type(m) for _, m in new]:
        log.warning(
            "guard_trainer: the model's modules are not those its config builds (changed after it was made?): the "
            "Trainer trains a new module from here on, and the model object this script holds is left behind"
        )
        return fresh
    keeper = {id(n): o for (_, o), (_, n) in zip(old, new, strict=True)}
    for (_, mine), (_, made) in zip(old, new, strict=True):
        state = dict(vars(made))
        state["_modules"] = {k: None if m is None else keeper[id(m)] for k, m in made._modules.items()}
        vars(mine).clear()
        vars(mine).update(state)
    for name, param in model.named_parameters(remove_duplicate=False):
        param.requires_grad_(name not in frozen)
    return model


def batch_for_world(trainer: Any, world_size: int) -> None:
    """DeepSpeed's ``train_batch_size`` for a world of ``world_size`` ranks, on a restarted rank.

    ``TrainingArguments`` fills the config's ``"auto"`` values when it is made, and a restarted
    process makes it on its stand-in world of one: ``train_batch_size`` came out as one rank's
    (micro-batch x accumulation), and DeepSpeed refuses it on the joined world ("train_batch_size is
    not equal to micro_batch_per_gpu * gradient_acc_step * world_size"); a number the user wrote
    was compared with one rank's too (a mismatch the Trainer raises on). Both are made again here
    for the joined world, as a first process's ``TrainingArguments`` made them.
    """
    args = trainer.args
    hf = getattr(args, "hf_deepspeed_config", None)
    if hf is None:
        return
    # No new HfTrainerDeepSpeedConfig here: making one points Transformers' global ZeRO-3 switch
    # (is_deepspeed_zero3_enabled, a weak reference) at it, and fresh_module would then build the
    # module outside zero.Init while the other ranks broadcast its parameters there.
    one = args.per_device_train_batch_size * args.gradient_accumulation_steps
    total = one * world_size
    stale = [m for m in hf.mismatches if m.startswith("- ds train_batch_size=")]
    hf.mismatches = [m for m in hf.mismatches if m not in stale]
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    configs = [hf.config, getattr(plugin, "deepspeed_config", None)]
    configs.append(getattr(getattr(plugin, "hf_ds_config", None), "config", None))
    for config in {id(c): c for c in configs if isinstance(c, dict)}.values():
        value = config.get("train_batch_size")
        if not stale and value == one:  # "auto", filled with one rank's
            config["train_batch_size"] = total
        elif value is not None and value != total:  # the user's number, compared with the joined world
            hf.mismatches.append(f"- ds train_batch_size={value} vs hf train_batch_size (calculated)={total}")


def _state_bound(model: torch.nn.Module) -> int:
    """The most bytes a restarted rank takes from its buddy: every parameter four times in fp32
    (ZeRO 1/2 keep the whole low-precision copy on every rank; master and Adam's two moments are
    partitions), the buffers, and 16 MiB for the Trainer's state, the generators and the scalars."""
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 16 * numel + buffers + (16 << 20)


class DeepSpeedPart:
    """What :class:`~ncclguard.integrations.hf.recovery.TrainerRecovery` does for a DeepSpeed Trainer
    (see the module doc).

    Args:
        trainer: the ``transformers.Trainer``.
        in_step: tells whether a step's transaction is open (the engine's ``step`` is held then).

    Attributes:
        engine: the engine the Trainer trains with now (None until ``train()`` built one).
        state: that engine's :class:`DeepSpeedState`.
    """

    def __init__(self, trainer: Any, in_step: Any) -> None:
        self.trainer, self._in_step = trainer, in_step
        self.engine: Any = None
        self.state: DeepSpeedState | None = None
        self._held: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
        self._carry: OwnState | None = None  # every rank alive: this rank's state for the next engine
        self._fetched: Fetched | None = None  # a restore's first half, for the next engine

    # --- the engine's step, held until the commit ------------------------------------------------

    def adopt(self, engine: Any, recovery: Recovery) -> None:
        """Takes the engine the Trainer just built: its ``step`` held inside a transaction, and the
        state kept for it put in (checked on every rank first).

        Raises:
            ValueError: an engine whose state :class:`DeepSpeedState` cannot take.
            HealFailed: a rank refused the state (nothing was copied anywhere).
        """
        # Accelerate calls engine.step() once per optimizer step (DeepSpeedEngineWrapper.backward).
        self.state, self.engine = DeepSpeedState(engine, step_per_micro_batch=False), engine
        original = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if self._in_step():  # applied by apply_held() once every rank committed
                self._held = (original, args, kwargs)
                return None
            return original(*args, **kwargs)

        step.__doc__ = "DeepSpeedEngine.step, held until the step's commit (ncclguard)"
        engine.step = step
        fetched, carry = self._fetched, self._carry
        self._fetched, self._carry = None, None
        if fetched is not None:
            recovery.put_snapshot_back(fetched).raise_for_error()
        elif carry is not None:
            at = int(carry.meta["counters"]["global_steps"])
            kept = Fetched(at, {}, [], "survivor", state=carry)
            put_back(self.state, kept, recovery.options.heal_timeout_s).raise_for_error()
            log.warning("guard_trainer: a new DeepSpeed engine holds this rank's state of global step %d", at)

    def apply_held(self) -> None:
        """The engine's step of a committed step (no-op when none was held)."""
        held, self._held = self._held, None
        if held is not None:
            original, args, kwargs = held
            original(*args, **kwargs)

    def drop_held(self) -> None:
        """Forgets a held step (the step failed)."""
        self._held = None

    # --- entering the loop again on a new world --------------------------------------------------

    def keep_for_next_engine(self) -> None:
        """Every rank alive: this rank's state as the failed step found it (``optimizer.step()`` ran
        nowhere), copied, since the Trainer destroys the old engine before it builds the next one."""
        assert self.state is not None  # a step ran, so an engine was adopted
        live = self.state.capture()
        self._carry = OwnState(
            {k: t.detach().clone() for k, t in live.tensors.items()}, json.loads(json.dumps(live.meta))
        )

    def discard(self, redo: bool) -> bool:
        """After a step whose gradients every rank refused (a NaN or an Inf): the engine keeps them in
        ZeRO's partitions and buckets, so a redo runs on a new engine on the same world, built by the
        Trainer as after a failure, with this rank's state as the step found it (``engine.step()``
        ran nowhere; :meth:`keep_for_next_engine`).

        Returns:
            Whether the Trainer must build that engine (``redo``); else the log says the engine
            still holds the refused gradients (``train()`` raises).
        """
        if not redo:
            log.warning(
                "guard_trainer: the DeepSpeed engine still holds the refused step's gradients; train() raises "
                "NonFiniteGradient (on_nonfinite='redo' runs the step again on a new engine)"
            )
            return False
        self.keep_for_next_engine()
        return True

    def enter_again(self, recovery: Recovery, joined: bool) -> dict[str, Any] | None:
        """Before ``train()`` is entered again on a new world: DeepSpeed's numbering and groups
        restart, the Trainer gets a fresh module, and with restarted ranks every rank takes its part
        of the newest snapshot (the step, the replicas; the copy waits for the engine).

        Args:
            recovery: the engine.
            joined: restarted ranks joined (every rank goes back to a snapshot).

        Returns:
            With ``joined``: the Trainer's state and the generators of the snapshot's step, for
            ``train()``'s resume. Otherwise None.

        Raises:
            HealFailed: no snapshot every rank can go back to, or a replica did not arrive or is bad.
        """
        trainer = self.trainer
        release_deepspeed_groups()
        number_parameters_afresh()
        if trainer.model_init is None:  # the script's model object, trained from here on (not left behind)
            trainer.model = renew_in_place(trainer.model)
        trainer.model_wrapped, trainer.deepspeed = trainer.model, None
        trainer.optimizer, trainer.lr_scheduler = None, None
        self.engine, self.state, self._held = None, None, None
        if not joined:
            return None
        fetched = recovery.fetch_snapshot(limit=_state_bound(trainer.model))
        if fetched is None:
            raise HealFailed("restarted ranks joined but this rank keeps no snapshots (heal=True on every rank?)")
        problem = str(fetched.error) if fetched.error is not None else fetched.refusal
        resume: dict[str, Any] | None = None
        if problem is None:
            resume, problem = _resume_from(fetched)
        agree(problem, f"the snapshot of step {fetched.step}", recovery.options.heal_timeout_s)
        self._fetched = fetched
        return resume


def _resume_from(fetched: Fetched) -> tuple[dict[str, Any] | None, str | None]:
    """The Trainer's state and the generators in a fetched snapshot, or why they cannot be read."""
    state = fetched.state
    meta = state.meta if state is not None else {}
    text = meta.get(_TRAINER)
    if not isinstance(text, str):
        return None, "the snapshot holds no Trainer state (taken by guard_trainer on every rank?)"
    try:
        from transformers import TrainerState

        TrainerState(**json.loads(text))  # what the Trainer will read: refused here if it cannot
        sent, gens = fetched.generators if fetched.generators is not None else (None, [])
        generators = from_json(sent, gens) if sent is not None else None
    except (TypeError, ValueError, KeyError, IndexError) as exc:  # every rank must reach the agreement
        return None, f"the snapshot's Trainer state or generators cannot be read: {exc}"
    return {"trainer_state": text, "scheduler": None, "generators": generators}, None


class TrainerStateCodec(CurrentEngineState):
    """The snapshots' view of a DeepSpeed Trainer: the current engine's own ZeRO state
    (:class:`DeepSpeedState`) and the Trainer's state (JSON text), which a restore resumes from."""

    def __init__(self, part: DeepSpeedPart) -> None:
        super().__init__(part, "the Trainer has built no DeepSpeed engine yet (train() builds it)")
        self.part = part

    def capture(self) -> OwnState:
        own = self.current().capture()
        own.meta[_TRAINER] = json.dumps(dataclasses.asdict(self.part.trainer.state))
        return own

    def check(self, state: OwnState) -> str | None:
        if not isinstance(state.meta.get(_TRAINER), str):
            return "the snapshot holds no Trainer state"
        return self.current().check(_engine_part(state))

    def apply(self, state: OwnState) -> None:
        self.current().apply(_engine_part(state))


def _engine_part(state: OwnState) -> OwnState:
    return OwnState(state.tensors, {k: v for k, v in state.meta.items() if k != _TRAINER})
