"""guard_trainer(recover=True) and recovering_step in this process: bad input, a step redone in a
world of one, and re-sharding the samplers after a shrink. The multi-rank cases are in
tests/integrations/test_hf_recover_multirank.py."""

from __future__ import annotations

import pytest
import torch
from tiny_trainer import tiny_trainer

from ncclguard.integrations.hf import find_guard, guard_trainer
from ncclguard.recovery._rebuild.repoint import repoint_ddp, repoint_sampler


def test_bad_recover_arguments_are_refused_before_anything_is_wrapped(tmp_path):
    trainer = tiny_trainer(tmp_path)
    with pytest.raises(TypeError, match="recover must be a bool"):
        guard_trainer(trainer, recover="yes")
    with pytest.raises(ValueError, match="allow_shrink needs recover=True"):
        guard_trainer(trainer, allow_shrink=True)
    with pytest.raises(ValueError, match="max_attempts must be an int of at least 1"):
        guard_trainer(trainer, recover=True, max_attempts=0)
    with pytest.raises(ValueError, match="collective_timeout must be a positive duration"):
        guard_trainer(trainer, recover=True, collective_timeout=0)
    with pytest.raises(ValueError, match="left_out must be 'exit' or 'raise'"):
        guard_trainer(trainer, recover=True, left_out="stay")
    with pytest.raises(ValueError):
        guard_trainer(trainer, recover=True, commit_timeout=-1)
    with pytest.raises(ValueError):
        guard_trainer(trainer, recover=True, rebuild_timeout=0)
    assert find_guard(trainer) is None and "training_step" not in vars(trainer)  # nothing half-done
    guard_trainer(trainer, recover=True, watchdog=False)
    assert "training_step" in vars(trainer) and find_guard(trainer).recovery is not None


def test_alone_a_step_that_raises_is_redone_once_and_logged(tmp_path):
    """A world of one: the micro-batch that raised fails the commit; the step's two micro-batches
    are run again from the same RNG state and the optimizer steps once, as in a clean run."""
    clean = tiny_trainer(tmp_path / "clean", eval_strategy="no", save_strategy="no", gradient_accumulation_steps=2)
    guard_trainer(clean, recover=True, watchdog=False)
    clean.train()

    trainer = tiny_trainer(tmp_path / "faulty", eval_strategy="no", save_strategy="no", gradient_accumulation_steps=2)
    guard_trainer(trainer, recover=True, watchdog=False)
    recovery = find_guard(trainer).recovery
    original, seen = recovery.original, []

    def once_failing(model, inputs, num_items=None):
        seen.append(trainer.state.global_step)
        if seen == [0, 0, 1, 1]:  # the second micro-batch of step 1, first attempt
            raise RuntimeError("injected: a backend error in the backward")
        return original(model, inputs, num_items)

    recovery.original = once_failing
    trainer.train()
    assert seen == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3]
    (rec,) = recovery.recoveries
    assert (rec.step, rec.attempts, rec.failed_ranks, rec.generation) == (1, 2, [0], 0)
    assert rec.metrics()["ncclguard_recover_failed_ranks"] == "0"
    (logged,) = [e for e in trainer.state.log_history if "ncclguard_recover_s" in e]
    assert logged["step"] == 1 and logged["ncclguard_recover_world_size"] == 1
    assert trainer.state.global_step == clean.state.global_step == 4
    # The optimizer and the LR scheduler stepped once per step: same learning rates, same losses
    # (the failed attempt's loss was replaced by the redo's), same parameters, bit for bit.
    assert _logged(trainer, "learning_rate") == _logged(clean, "learning_rate")
    assert _logged(trainer, "loss") == _logged(clean, "loss")
    for a, b in zip(trainer.model.parameters(), clean.model.parameters(), strict=True):
        assert torch.equal(a, b)


class _FailsAfter:
    """A callback whose ``on_step_end`` raises once at each of the given global steps."""

    def __init__(self, steps: set[int], error: type[Exception]) -> None:
        from transformers import TrainerCallback

        fails = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if state.global_step in fails.steps:
                    fails.steps.discard(state.global_step)
                    raise error("injected: Connection closed by peer")

        self.steps, self.callback = set(steps), Callback()


def test_alone_a_backend_failure_between_steps_fails_the_next_step_and_one_after_the_last_is_settled(tmp_path):
    """Issue 59, a kill between steps, in a world of one: a collective that fails between two steps (here in an
    ``on_step_end`` callback, with the ``DistBackendError`` of a backend) is not raised out of
    ``train()``: the next step fails on the rank and is redone; after the last step the failure is
    settled before ``train()`` returns; the run ends bit-equal to a clean one. A user's bug there
    (not a backend failure) is raised as before."""
    clean = tiny_trainer(tmp_path / "clean", eval_strategy="no", save_strategy="no")
    guard_trainer(clean, recover=True, watchdog=False)
    clean.train()

    fails = _FailsAfter({2, 4}, torch.distributed.DistBackendError)
    trainer = tiny_trainer(tmp_path / "faulty", callbacks=[fails.callback], eval_strategy="no", save_strategy="no")
    guard_trainer(trainer, recover=True, watchdog=False)
    trainer.train()
    recovery = find_guard(trainer).recovery
    assert [(r.step, r.attempts, r.failed_ranks) for r in recovery.recoveries] == [(2, 2, [0]), (4, 2, [0])]
    assert trainer.state.global_step == clean.state.global_step == 4
    assert _logged(trainer, "loss") == _logged(clean, "loss")
    for a, b in zip(trainer.model.parameters(), clean.model.parameters(), strict=True):
        assert torch.equal(a, b)

    bug = _FailsAfter({2}, KeyError)
    trainer = tiny_trainer(tmp_path / "bug", callbacks=[bug.callback], eval_strategy="no", save_strategy="no")
    guard_trainer(trainer, recover=True, watchdog=False)
    try:
        with pytest.raises(KeyError, match="injected"):
            trainer.train()
    finally:
        find_guard(trainer).on_train_end(trainer.args, trainer.state, trainer.control)  # the phase it left open


def _logged(trainer, key: str) -> list[tuple[int, float]]:
    return [(e["step"], e[key]) for e in trainer.state.log_history if key in e]


def test_repoint_sampler_reshards_a_distributed_sampler_and_a_batch_sampler_shard():
    from accelerate.data_loader import BatchSamplerShard

    data = list(range(23))
    old = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=2, shuffle=True, seed=5, drop_last=True)
    loader = torch.utils.data.DataLoader(data, sampler=old, batch_size=2)
    assert repoint_sampler(loader, 1, 2) == ["DistributedSampler rank/num_replicas (2, 3) -> (1, 2)"]
    want = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=True)
    assert (old.num_samples, old.total_size) == (want.num_samples, want.total_size) == (11, 22)
    assert list(old) == list(want)

    inner = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), batch_size=2, drop_last=False)
    shard = BatchSamplerShard(inner, num_processes=3, process_index=0)
    loader = torch.utils.data.DataLoader(data, batch_sampler=shard)
    assert repoint_sampler(loader, 1, 2) == ["BatchSamplerShard process_index/num_processes (0, 3) -> (1, 2)"]
    fresh = BatchSamplerShard(inner, num_processes=2, process_index=1)
    assert list(shard) == list(fresh) and len(shard) == len(fresh)
    assert repoint_sampler(torch.utils.data.DataLoader(data), 0, 2) == []  # nothing sharded: nothing said


def test_repoint_ddp_leaves_what_is_not_ddp_alone():
    assert repoint_ddp(torch.nn.Linear(2, 2)) is False


def test_an_fsdp_trainer_is_refused_naming_what_to_use_instead(tmp_path):
    """Accelerate applies the Trainer's FSDP only on GPU-like devices (accelerate/state.py); on this
    CPU machine ``fsdp=`` is not in force (tests/integrations/test_hf_deepspeed_multirank.py reads it). So the one
    flag Accelerate's state would set on a GPU stands in for it here, on a real Trainer."""
    trainer = tiny_trainer(tmp_path)
    trainer.is_fsdp_enabled = True
    with pytest.raises(ValueError) as refused:
        guard_trainer(trainer, recover=True, watchdog=False)
    text = str(refused.value)
    assert text.startswith("recover=True cannot recover the Trainer's FSDP: Accelerate wraps the model in FSDP only")
    assert "ncclguard.RecoveringStep(model, optimizer, wrap=ncclguard.FSDP2(...), heal=True)" in text
    assert "the Trainer with deepspeed= (ZeRO 1, 2 or 3)" in text
    assert find_guard(trainer) is None and "training_step" not in vars(trainer)  # refused before any wrapping


def test_the_trainer_callbacks_old_name_still_imports_with_a_warning() -> None:
    # One name per public class: Lightning's callback is NcclGuardCallback, the Trainer's TrainerGuardCallback.
    from ncclguard.integrations import hf, lightning

    with pytest.warns(DeprecationWarning, match="TrainerGuardCallback now"):
        old = hf.NcclGuardCallback
    assert old is hf.TrainerGuardCallback and old is not lightning.NcclGuardCallback
    assert "NcclGuardCallback" not in hf.__all__
    with pytest.raises(AttributeError):
        hf.NoSuchName  # noqa: B018 - the module's __getattr__ refuses other names


def test_a_module_renewed_in_place_is_the_scripts_object_with_new_parameters_ties_and_frozen_ones_kept():
    """Issue 59: the redo on a new DeepSpeed engine renews the Trainer's model in place, so that the
    object a script holds (and its submodules) is the module trained after a heal; the tied weights
    stay tied, a frozen parameter stays frozen, a module tree that is not the config's is left alone."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ncclguard.integrations.hf.deepspeed import renew_in_place

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    block, wte = model.transformer.h[0], model.transformer.wte.weight
    model.transformer.wpe.weight.requires_grad_(False)
    rng = torch.get_rng_state()
    assert renew_in_place(model) is model
    assert model.transformer.h[0] is block and model.transformer.wte.weight is not wte  # modules kept, parameters new
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["transformer.wpe.weight"]
    assert torch.equal(torch.get_rng_state(), rng)  # the fresh module's draws moved no generator
    out = model(torch.arange(8).unsqueeze(0), labels=torch.arange(8).unsqueeze(0))
    out.loss.backward()  # a working module: its gradients reach the parameters it holds now
    assert model.transformer.wte.weight.grad is not None and model.transformer.wpe.weight.grad is None
    model.transformer.extra = torch.nn.Linear(2, 2)  # a tree the config does not build: not renewed
    assert renew_in_place(model) is not model
