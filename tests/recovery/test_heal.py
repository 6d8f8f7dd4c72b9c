"""Healing a restarted rank, the parts that need no process group: the launcher's restart policy
(real processes), the optimizer's state as JSON, what a receiver refuses, the rejoin's store
records on a real TCPStore, and bad input refused before any communication."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ncclguard
from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed, StoreUnreachable
from ncclguard.recovery._rebuild.meeting import Arrival, MeetingOutcome, WorldRecord, check_arrivals
from ncclguard.recovery.heal_header import Header
from ncclguard.recovery.heal_header import check_header as _check
from ncclguard.recovery.heal_header import make_header as _header
from ncclguard.recovery.rejoin import _live_attempt
from ncclguard.recovery.state_json import from_json as _from_json
from ncclguard.recovery.state_json import to_json as _to_json
from ncclguard.store.codec import encode
from ncclguard.store.keys import MeetingKeys, world_record_key
from ncclguard.store.world_record import read_world_record
from ncclguard.testing.launch import spawn

# A rank that prints its life, and dies by SIGKILL while its restart count is below DIE_UNTIL.
SCRIPT = """
import os, signal, sys
rank, life = os.environ["RANK"], int(os.environ["NCCLGUARD_RESTART_COUNT"])
print(f"rank {rank} life {life}", flush=True)
if rank == "1" and life < int(sys.argv[1]):
    os.kill(os.getpid(), int(sys.argv[2]))
sys.exit(int(sys.argv[3]) if rank == "1" else 0)
"""


def _run(die_until: int, restarts: int, restart_on=None, sig: int = signal.SIGKILL, code: int = 0):
    argv = [sys.executable, "-c", SCRIPT, str(die_until), str(int(sig)), str(code)]
    return spawn(argv, 2, timeout_s=60, restarts=restarts, restart_on=restart_on)


def test_a_killed_rank_is_restarted_alone_with_the_same_rank_and_its_restart_count():
    res = _run(die_until=1, restarts=1)
    assert res.ok and not res.timed_out
    assert [(r.rank, r.count, r.returncode) for r in res.restarts] == [(1, 1, -9)]
    assert [(r.rank, r.lives, r.restarts) for r in res.ranks] == [(0, [0], 0), (1, [-9, 0], 1)]
    assert res.ranks[0].stdout == "rank 0 life 0\n"
    assert res.ranks[1].stdout == (
        "rank 1 life 0\n# ncclguard.testing.launch: rank 1 exited -9; restart 1\nrank 1 life 1\n"
    )


def test_restarts_are_bounded_and_logged():
    res = _run(die_until=99, restarts=2)
    assert not res.ok
    assert [(r.rank, r.count, r.returncode) for r in res.restarts] == [(1, 1, -9), (1, 2, -9)]
    assert res.ranks[1].lives == [-9, -9, -9] and res.ranks[1].returncode == -9
    assert res.restarts[0].at_s <= res.restarts[1].at_s < res.wall_s


def test_restart_on_picks_the_exits_that_earn_a_restart():
    # SIGKILL is not in restart_on: no restart.
    res = _run(die_until=1, restarts=1, restart_on=[3])
    assert res.restarts == [] and res.ranks[1].lives == [-9]
    # Exit status 3 is: one restart, which exits 3 again (the restart budget is spent).
    res = _run(die_until=0, restarts=1, restart_on=[3], code=3)
    assert [(r.rank, r.returncode) for r in res.restarts] == [(1, 3)] and res.ranks[1].lives == [3, 3]
    # A rank that exits 0 is never restarted.
    res = _run(die_until=0, restarts=3)
    assert res.ok and res.restarts == [] and res.ranks[1].lives == [0]


def test_the_supervisor_restarts_one_rank_alone_posts_each_death_and_passes_on_the_last_status(capfd, tmp_path):
    from ncclguard.store.deaths import read_deaths
    from ncclguard.supervise.__main__ import main

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RANK", "1")
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(server.port))
        mp.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        assert main(["--restarts", "1", "--", sys.executable, "-c", SCRIPT, "1", str(int(signal.SIGKILL)), "0"]) == 0
        out, err = capfd.readouterr()
        assert out == "rank 1 life 0\nrank 1 life 1\n"
        assert err == f"ncclguard.supervise: the rank (pid {_pid(err)}) exited -9; restart 1 of 1\n"
        # A rank that keeps dying ends with 128 + 9, as a shell reports it.
        assert main(["--restarts", "1", "--", sys.executable, "-c", SCRIPT, "9", "9", "0"]) == 137
        # The warm spare: a standby that imported torch runs the script when the rank dies.
        assert main(["--restarts", "2", "--warm-spare", "--", sys.executable, str(script), "2", "9", "0"]) == 0
        out, err = capfd.readouterr()
        assert out.splitlines()[-3:] == ["rank 1 life 0", "rank 1 life 1", "rank 1 life 2"]
        assert err.count("the warm spare (pid ") == 2
    # Every death was posted in the job's store, the last of a rank out of restarts too: 1 + 2 + 2.
    _, notices = read_deaths(server, 0)
    assert [(n.origin, n.returncode, n.life) for n in notices] == [
        (1, -9, 0),
        (1, -9, 0),
        (1, -9, 1),
        (1, -9, 0),
        (1, -9, 1),
    ]
    with pytest.raises(SystemExit):  # argparse's error: the command after -- is missing
        main(["--restarts", "1", "--"])
    with pytest.raises(SystemExit):  # a spare takes over a Python script or module only
        main(["--restarts", "1", "--warm-spare", "--", "/bin/true"])


def _pid(err: str) -> int:
    return int(err.split("(pid ", 1)[1].split(")", 1)[0])


def test_spawn_refuses_a_bad_restart_policy():
    with pytest.raises(ValueError, match="restarts must be an int >= 0"):
        spawn([sys.executable, "-c", "pass"], 1, timeout_s=5, restarts=-1)
    with pytest.raises(ValueError, match="restart_on must hold non-zero exit codes"):
        spawn([sys.executable, "-c", "pass"], 1, timeout_s=5, restarts=1, restart_on=[0])


def test_restart_count_reads_the_launchers_variable(monkeypatch):
    monkeypatch.delenv("NCCLGUARD_RESTART_COUNT", raising=False)
    assert ncclguard.restart_count() == 0
    monkeypatch.setenv("NCCLGUARD_RESTART_COUNT", "2")
    assert ncclguard.restart_count() == 2
    monkeypatch.setenv("NCCLGUARD_RESTART_COUNT", "two")
    with pytest.raises(ValueError, match="NCCLGUARD_RESTART_COUNT='two' is not a non-negative integer"):
        ncclguard.restart_count()


def _adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).double()
    opt = torch.optim.Adam(module.parameters(), lr=0.1, betas=(0.8, 0.9))
    module(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    return module, opt


def test_the_optimizers_state_goes_as_json_and_comes_back_equal():
    _, opt = _adam()
    sd = opt.state_dict()
    tensors: list[torch.Tensor] = []
    text = json.dumps(_to_json(sd, tensors, "state_dict"), allow_nan=False)
    back = _from_json(json.loads(text), tensors)
    assert back["param_groups"] == sd["param_groups"]  # betas stays a tuple, keys stay ints
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert sorted(back["state"]) == sorted(sd["state"]) == [0, 1, 2, 3]
    for i, s in sd["state"].items():
        assert all(back["state"][i][k] is v for k, v in s.items())
    assert len(tensors) == 12  # exp_avg, exp_avg_sq, step for 4 parameters
    assert _to_json({"x": float("inf")}, [], "s") == {"d": [["x", {"f": "inf"}]]}
    assert _from_json({"f": "inf"}, []) == float("inf")


def test_state_that_is_not_json_or_tensors_is_refused_never_pickled():
    with pytest.raises(HealFailed, match=r"state_dict\['state'\]\[0\]\['fn'\] is a function"):
        _to_json({"state": {0: {"fn": lambda: 0}}}, [], "state_dict")
    with pytest.raises(ValueError, match="unknown tag"):
        _from_json({"p": "cos\nsystem\n"}, [])


def test_a_receiver_checks_names_dtypes_shapes_sizes_and_groups():
    module, opt = _adam()
    header, sent = _header(module, opt, 7, 64)
    assert header.step == 7 and header.module_tensors == 7  # 4 parameters, 2 running stats and a count
    assert [(e.name, e.dtype, e.shape) for e in header.tensors[:7]] == [
        ("p:0.weight", "torch.float64", [2, 3]),
        ("p:0.bias", "torch.float64", [2]),
        ("p:1.weight", "torch.float64", [2]),
        ("p:1.bias", "torch.float64", [2]),
        ("b:1.running_mean", "torch.float64", [2]),
        ("b:1.running_var", "torch.float64", [2]),
        ("b:1.num_batches_tracked", "torch.int64", []),
    ]
    assert len(header.tensors) == 7 + 12 and len(sent) == 19  # and Adam's 3 per parameter
    fresh, fresh_opt = _adam()
    assert _check(header, fresh, fresh_opt, 1 << 20) is None
    assert _check(header, fresh, fresh_opt, 100) == (
        f"the source would send {sum(t.numel() * t.element_size() for t in sent)} bytes, over this receiver's "
        "bound of 100 (max_bytes=)"
    )
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))  # float32
    assert _check(header, other, torch.optim.Adam(other.parameters()), 1 << 20) == (
        "p:0.weight torch.float64[2, 3] does not match this module's p:0.weight torch.float32[2, 3]"
    )
    split = torch.optim.Adam([{"params": list(fresh.parameters())[:2]}, {"params": list(fresh.parameters())[2:]}])
    assert _check(header, fresh, split, 1 << 20) == (
        "the source's optimizer has parameter groups of sizes [4], this one [2, 2]"
    )
    assert _check(header, fresh, None, 1 << 20) == (
        "the source and this rank disagree on whether there is an optimizer to heal"
    )
    assert Header.model_validate_json(header.model_dump_json()) == header


def test_heal_and_rejoin_refuse_bad_input_before_any_communication(monkeypatch):
    module, opt = _adam()
    with pytest.raises(TypeError, match="needs the torch.nn.Module"):
        ncclguard.heal_from_peer(object(), opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        ncclguard.heal_from_peer(module, opt, chunk_bytes=0)
    with pytest.raises(ValueError, match="after rebuild_world / rejoin_world"):
        ncclguard.heal_from_peer(module, opt)
    with pytest.raises(ValueError, match="rank must be the launch rank"):
        ncclguard.rejoin_world(rank=-1)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="rejoin_world needs the job's store: pass store="):
        ncclguard.rejoin_world(rank=1)
    with pytest.raises(TypeError, match="heal must be True or False"):
        ncclguard.RecoveringStep(module, opt, heal=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="heal_chunk_bytes must be a positive int"):
        ncclguard.RecoveringStep(module, opt, heal=True, heal_chunk_bytes=0)


def test_the_world_record_and_the_live_attempt_on_a_real_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    deadline = Deadline.within(30)
    assert read_world_record(store, deadline) is None
    rec = WorldRecord(generation=2, origins=[0, 2, 3], backend="gloo", timeout_s=6.0)
    store.set(world_record_key(), encode(rec))
    assert read_world_record(store, deadline) == rec and rec.rank_of(2) == 1 and rec.rank_of(1) is None
    assert _live_attempt(store, 3, deadline) == (0, None)
    failed = MeetingOutcome(arrived=[0, 2], ok=False, shrunk=True)
    store.set(MeetingKeys(3, 0).outcome, encode(failed))
    assert _live_attempt(store, 3, deadline) == (1, failed)
    store.set(world_record_key(), "x" * 100 + "{")
    with pytest.raises(StoreUnreachable, match="the job's world record cannot be read"):
        read_world_record(store, deadline)


def test_a_rejoined_arrival_takes_the_worlds_backend_and_never_objects_to_a_shrink():
    def arrival(rank: int, **kw: object) -> Arrival:
        base = dict(rank=rank, world_size=4, generation=0, backend="gloo", allow_shrink=True, host="h", pid=1)
        return Arrival(**{**base, **kw})  # type: ignore[arg-type]

    verdict = MeetingOutcome(arrived=[0, 1, 2], ok=True, shrunk=True)
    rejoined = arrival(1, backend="nccl", allow_shrink=False, rejoined=True, origin=1)
    assert check_arrivals(verdict, {0: arrival(0), 1: rejoined, 2: arrival(2)}, 4) is None
    plain = arrival(1, backend="nccl")
    assert check_arrivals(verdict, {0: arrival(0), 1: plain, 2: arrival(2)}, 4) == (
        "the ranks disagree on the backend they leave (rank 0: 'gloo', rank 1: 'nccl', rank 2: 'gloo')"
    )


_REJOINER = """
import json, sys, time
import torch.distributed as dist
import ncclguard
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=False, wait_for_workers=False)
t0 = time.monotonic()
res = ncclguard.rejoin_world(rank=int(sys.argv[1]), store=store, timeout=60)
print(json.dumps({"ok": bool(res), "error": str(res.error), "s": time.monotonic() - t0}))
"""


def test_a_world_of_restarted_processes_alone_fails_at_once_saying_nobody_holds_the_state(tmp_path):
    """Every rank of a job died and was restarted (its survivors raised and their supervisors restarted
    them too): the restarted processes meet each other, and none of them holds the state or records
    the world. Before, each waited out its 60 s for a record, then said it "was agreed without this
    rank and never recorded". Now the meeting's outcome says so at once."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLGUARD_", "TORCHELASTIC_"))}
    env.update(WORLD_SIZE="2", NCCLGUARD_RESTART_COUNT="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _REJOINER, str(r), str(server.port)], env=env, stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    for out in outs:
        assert out["ok"] is False
        assert "every member of generation 1 is a restarted process (launch ranks [0, 1])" in out["error"]
        assert out["s"] < 30, out  # at the meeting, not at the 60 s timeout (a hang guard, not a speed target)
