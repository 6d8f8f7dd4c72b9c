"""The backend's rules (``ncclguard/backend_rules.py``): what each backend carries, how it is released
and bounded, the NCCL stand-in's switch, and the refusal of a CPU tensor on a group that carries none."""

from __future__ import annotations

import pytest
import torch

from ncclguard.backend_rules import STAND_IN_VAR, ReleaseBy, StepBoundBy, rules_of, stand_in_on, survivor_handling
from ncclguard.errors import BackendRuleError, NcclGuardError


@pytest.mark.parametrize(
    ("backend", "stand_in", "carries_cpu", "release", "bound"),
    [
        ("gloo", False, True, ReleaseBy.SOCKETS, StepBoundBy.TIMEOUT),
        ("gloo", True, False, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER),
        ("nccl", False, False, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER),
        ("nccl", True, False, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER),  # the stand-in is for gloo alone
        ("cpu:gloo,cuda:nccl", False, True, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER),
        ("cpu:gloo,cuda:nccl", True, True, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER),
        ("ucc", False, False, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER),
        ("mpi", False, True, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER),
    ],
)
def test_each_backend_has_its_rules(backend, stand_in, carries_cpu, release, bound):
    rules = rules_of(backend, stand_in)
    assert (rules.carries_cpu, rules.release, rules.step_bound) == (carries_cpu, release, bound)
    assert rules.stand_in == (stand_in and backend == "gloo")
    assert rules.nccl == (not carries_cpu)


def test_a_cpu_tensor_on_a_group_that_carries_none_is_refused_with_what_to_do():
    cpu = torch.zeros(3)
    rules_of("gloo").check_carry(cpu, "x")  # gloo carries it
    rules_of("cpu:gloo,cuda:nccl").check_carry(cpu, "x")
    with pytest.raises(BackendRuleError) as real:
        rules_of("nccl").check_carry(cpu, "heal_from_peer, the header")
    assert isinstance(real.value, NcclGuardError) and isinstance(real.value, ValueError)
    assert str(real.value).startswith("heal_from_peer, the header: a CPU tensor on an NCCL group")
    assert "side gloo group" in str(real.value)
    with pytest.raises(BackendRuleError, match=r"NCCL stand-in's default group \(NCCLGUARD_NCCL_STAND_IN\)"):
        rules_of("gloo", stand_in=True).check_carry(cpu, "x")
    rules_of("nccl").check_carry(torch.zeros(3, device="meta"), "x")  # not on the CPU: the device's to carry


def test_the_stand_in_switch_reads_0_1_or_nothing_and_refuses_anything_else(monkeypatch):
    monkeypatch.delenv(STAND_IN_VAR, raising=False)
    assert not stand_in_on()
    for value, on in (("1", True), ("0", False), ("", False), (" 1 ", True)):
        monkeypatch.setenv(STAND_IN_VAR, value)
        assert stand_in_on() is on
    monkeypatch.setenv(STAND_IN_VAR, "yes")
    with pytest.raises(ValueError, match=r"NCCLGUARD_NCCL_STAND_IN must be 1 .* got 'yes'"):
        stand_in_on()


def test_an_abort_of_groups_already_aborted_says_so_and_raises_nothing(monkeypatch):
    """A release after the step bound's timer (or two releases) aborts the same groups again: harmless."""
    import torch.distributed as dist

    from ncclguard.recovery._verdict.levers import abort_world

    monkeypatch.delenv("MASTER_PORT", raising=False)  # no job: the stand-in cuts toward nobody
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rules = rules_of("gloo", stand_in=True)
        assert abort_world(rules) == (["0"], [], 0)  # no job's process to cut toward
        assert abort_world(rules) == (["0"], [], 0)
    finally:
        dist.destroy_process_group()


BOTH = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250"}


@pytest.mark.parametrize(
    ("environ", "group_made", "to_set", "said"),
    [
        ({}, False, BOTH, None),
        ({}, True, BOTH, "made with TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's default"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, False, BOTH, "=3 is replaced by 2 for the ranks"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, True, BOTH, "made with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torchrun"),
        ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, False, BOTH, "=1 is replaced"),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "500"}, True, {}, None),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, True, {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250"}, None),
    ],
)
def test_a_survivor_of_a_peers_death_needs_nccl_error_handling_2_and_a_bounded_dump_wait(
    environ, group_made, to_set, said
):
    got, warning = survivor_handling(environ, group_made)
    assert got == to_set
    if said is None:
        assert warning is None
    else:
        assert warning is not None and said in warning and "exit -6" in warning
        if group_made:
            assert (
                "set TORCH_NCCL_ASYNC_ERROR_HANDLING=2" in warning and "ncclguard run --ncclguard-restarts" in warning
            )
