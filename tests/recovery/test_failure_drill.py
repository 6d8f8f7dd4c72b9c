"""The failure drill's short form (benchmarks/failure_drill.py --short): a fault-free run, a run with
a stall past the step bound, and a run whose ranks are killed (SIGKILL) and restarted by their
supervisor from a warm spare; 3 real gloo ranks each under torchrun. Then the sharded stacks'
restart-from-disk baseline (``--framework fsdp2 --modes disk``): plain FSDP2, DCP checkpoints,
torchrun restarting every rank after each kill; a drill (`make drills`): it checks the benchmark's baseline, no
ncclguard code (an FSDP2 job's DCP checkpoint resumed bit-equal stays in the suite in
tests/recovery/test_preempt_multirank.py, ``fsdp2``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

REPO = Path(__file__).parents[2]


def test_the_short_drill_recovers_every_stall_and_reports_its_numbers(tmp_path):
    out = tmp_path / "drill.json"
    modes = ["clean", "stall", "spare"]
    cmd = [sys.executable, str(REPO / "benchmarks" / "failure_drill.py"), "--short", "--modes", *modes]
    # Three launches of ~50 s each on a loaded 2-core host (most of it starting 3 processes each);
    # hang guard over 3x that. Each launch has its own bound inside (300 s).
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    clean, stall, spare = res["runs"]["clean"], res["runs"]["stall"], res["runs"]["spare"]
    # The target: with stalls only, the final parameters are bit-equal to the clean run's
    # (SHA-256 of every parameter). It holds with DDP(find_unused_parameters=True): see
    # docs/reference/recovery-mechanism.md, "Bit-equality and DDP's buckets".
    assert res["summary"]["stall_bit_equal_to_clean"] is True
    for run in (clean, stall, spare):
        assert run["committed"] == run["steps"] == 60
        assert 0 < run["efficiency"] <= 1 and run["efficiency"] == run["committed"] / run["attempted"]
        assert run["steps_per_s"] > 0 and run["equal_across_ranks"] is True and run["same_digest_on_survivors"]
        assert (run["world_size"], run["survivors"], run["torchrun_rc"]) == (3, 3, 0)
    assert clean["faults"] == 0
    # The fault-free run: no step redone, no rebuild.
    assert (clean["attempted"], clean["recoveries"], clean["generation"]) == (60, [], 0)
    assert stall["faults"] >= 1  # a stall every 6 s
    assert stall["attempted"] > stall["committed"]  # at least one step was redone
    assert [r["attempts"] for r in stall["recoveries"]] == [2] * len(stall["recoveries"])
    # Kills: each one's death posted by the supervisor (the survivors' commit settled without
    # waiting for the dead rank), a warm spare took its place, it was healed, the step redone.
    assert spare["faults_injected"] >= 1 and len(spare["restarts"]) == spare["faults_injected"]
    assert sum(len(rec["healed"]) for rec in spare["recoveries"]) == spare["faults_injected"]
    for rec in spare["recoveries"]:
        assert rec["attempts"] >= 2 and rec["early"] is True and rec["healed"]
    assert res["summary"]["spare_bit_equal_to_clean"] is True
    assert res["runs"].keys() == set(modes)


# A drill (`make drills`): the drill's baseline, no ncclguard in its ranks (the module doc).
@pytest.mark.drill
def test_the_short_disk_baseline_resumes_fsdp2_from_its_dcp_checkpoint_and_accounts_for_every_lost_step(tmp_path):
    # One torchrun launch of 3 plain FSDP2 ranks (no ncclguard), a DCP checkpoint every 20 steps, a
    # kill every 6 s that torchrun answers by restarting every rank: 30-60 s here. Hang guard 3x.
    out = tmp_path / "drill.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "failure_drill.py"), "--short", "--framework", "fsdp2"]
    cmd += ["--modes", "disk", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    disk = json.loads(out.read_text())["runs"]["disk"]
    assert (disk["committed"], disk["steps"], disk["world_size"], disk["survivors"]) == (60, 60, 3, 3)
    assert disk["same_digest_on_survivors"] is True and disk["torchrun_rc"] == 0
    kills = disk["disk_parts"]["kills"]
    # Every kill ended the job and torchrun relaunched it once; each relaunch resumed from the newest
    # checkpoint at or before the interrupted step and redid the steps since.
    assert disk["faults_injected"] >= 1 and disk["restarts"] == disk["faults_injected"] == len(kills)
    for kill in kills:
        assert kill["from_step"] % 20 == 0 and kill["from_step"] <= kill["killed_step"]
        assert kill["lost_steps"] == kill["killed_step"] - kill["from_step"]
        assert min(kill["relaunch"], kill["start"], kill["load"], kill["redo"]) > 0
    # Attempted: the 60 steps, each lost step again, and the step each kill interrupted.
    assert disk["attempted"] == 60 + sum(k["lost_steps"] for k in kills) + len(kills)
    assert disk["efficiency"] == 60 / disk["attempted"] < 1
    # The checkpoints stay under the drill's own directory: the two newest DCP checkpoints and latest.txt.
    ckpt = tmp_path / "work" / "disk" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.txt", "step20", "step40"]
    assert (ckpt / "latest.txt").read_text() == "40"
