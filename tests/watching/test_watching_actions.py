"""The action ladder without a job: building it (names and your own Action), the climbing rule,
and each built-in rung on its own (raise by a real signal into this main thread, abort on a real
world-of-one gloo group, exit in a child process), then a custom rung fired by a real Watchdog
thread on a synthetic hang."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ncclguard.errors import CollectiveTimeout
from ncclguard.incidents.model import IncidentDoc, IncidentKind, MergedNote, OpRecord
from ncclguard.recording.flight import recorder
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.ladder.actions import (
    Abort,
    Action,
    ActionContext,
    Exit,
    Fence,
    IncidentRef,
    Ladder,
    LadderState,
    MainThreadRaiser,
    Outcome,
    Raise,
    Report,
    build_ladder,
)
from ncclguard.watching.watchdog import Watchdog

DOC = IncidentDoc(
    kind=IncidentKind.HANG, reason="rank 0 waited", id="x-001", created=time.time(), group="0", seq=7, op="barrier"
)


class Note(Action):
    name = "note"

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        self.seen.append((incident.doc.id, ctx.rank))
        return Outcome(done=True, details={"n": len(self.seen)})


class Broken(Action):
    name = "broken"

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        raise ValueError("disk full")


def ctx(**kw) -> ActionContext:
    fields = dict(
        config=WatchdogConfig(), rank=0, main_ident=None, raiser=None, blocked_in=lambda: None, save=lambda o: None
    )
    return ActionContext(**{**fields, **kw})


def test_the_ladder_is_built_from_names_and_your_own_actions():
    assert [a.name for a in build_ladder("report")] == ["report"]
    assert [type(a) for a in build_ladder("exit")] == [Report, Raise, Abort, Exit]
    note = Note()
    ladder = build_ladder("report", [note, "exit"])
    assert ladder[1] is note and [a.name for a in ladder] == ["report", "note", "exit"]  # report first
    assert [a.name for a in build_ladder("exit", ["report", "abort"])] == ["report", "abort"]
    assert [type(a) for a in build_ladder("fence")] == [Report, Abort, Fence]  # no raise, no exit
    assert build_ladder("fence", fence_after_s=4.0)[2].wait_s == 4.0
    with pytest.raises(
        TypeError, match="each of actions must be one of \\['report', 'raise', 'abort', 'fence', 'exit'\\]"
    ):
        build_ladder("report", ["kill"])
    with pytest.raises(TypeError, match="got <function"):
        build_ladder("report", [lambda incident, ctx: None])
    assert Ladder(build_ladder("raise"), 1.0).needs_main_thread and not Ladder([Report(), note], 1.0).needs_main_thread
    with pytest.raises(ValueError, match="exit code must be in 1..255"):
        Exit(0)


def test_the_ladder_climbs_a_rung_per_escalation_until_resolved_or_the_top():
    note = Note()
    ladder = Ladder([Report(), note, Broken(), note], escalate_after_s=10.0)
    state = LadderState()
    ref = IncidentRef(DOC, Path("/tmp/x"))

    def run(action, step):
        return action(ref, ctx())

    ladder.start(state, now=100.0, run=run)
    assert [(s.rung, s.outcome.done) for s in state.steps] == [("report", True)]
    assert ladder.climb(state, 100.0, lambda: False, run) == "stepped"  # the next rung follows at once
    assert ladder.climb(state, 105.0, lambda: False, run) == "waiting"
    assert ladder.climb(state, 110.0, lambda: False, run) == "stepped"  # a failing rung is recorded, not fatal
    assert ladder.climb(state, 120.0, lambda: False, run) == "stepped"
    assert ladder.climb(state, 200.0, lambda: False, run) == "settled" and state.settled
    entries = [s.entry().to_json() for s in state.steps]
    assert [(e["rung"], e["done"]) for e in entries] == [
        ("report", True),
        ("note", True),
        ("broken", False),
        ("note", True),
    ]
    assert entries[2]["why"] == "failed: ValueError: disk full" and entries[3]["n"] == 2
    assert note.seen == [("x-001", 0), ("x-001", 0)]
    # A hang that clears stops the climb.
    state = LadderState()
    ladder.start(state, 0.0, run)
    assert ladder.climb(state, 0.0, lambda: True, run) == "resolved" and state.settled
    assert [s.rung for s in state.steps] == ["report", "resolved"]


def _raise_from_another_thread(raiser: MainThreadRaiser, **kw) -> tuple[Outcome | None, BaseException | None]:
    """Runs the raise rung in a thread, as the watchdog does, while this main thread waits in Python."""
    out: list[Outcome] = []
    action = threading.Thread(
        target=lambda: out.append(
            Raise()(
                IncidentRef(DOC, Path("/tmp/x")), ctx(raiser=raiser, main_ident=threading.main_thread().ident, **kw)
            )
        )
    )
    caught = None
    try:
        action.start()
        deadline = time.monotonic() + 30  # a hang guard: a loaded machine may run the thread seconds late
        while time.monotonic() < deadline and (action.is_alive() or not out):
            time.sleep(0.01)
        time.sleep(0.05)  # a signal lands between bytecodes: give it some
    except CollectiveTimeout as exc:
        caught = exc
    action.join(30)  # a hang guard
    return (out[0] if out else None), caught


def test_raise_reaches_the_main_thread_by_its_signal():
    done: list[tuple[str, int]] = []
    raiser = MainThreadRaiser(signal.SIGUSR2, lambda key: key in done)
    raiser.install(lambda signum, frame: raiser.on_signal(signum, frame))
    try:
        outcome, caught = _raise_from_another_thread(raiser)
        assert outcome == Outcome(done=True) and isinstance(caught, CollectiveTimeout)
        assert str(caught).startswith("ncclguard watchdog, incident x-001: rank 0 waited; report in /tmp/x")
        assert (caught.op, caught.group) == ("barrier", "0")
        # The hung op completed on this rank before the signal landed: dropped, not raised.
        done.append(("0", 7))
        outcome, caught = _raise_from_another_thread(raiser)
        assert caught is None and outcome is not None and not outcome.done
        assert outcome.why == "dropped: op #7 on group 0 completed on this rank before the signal landed"
        # A main thread blocked in C++ is skipped.
        blocked = OpRecord(seq=3, op="all_reduce(SUM)", group="0", start=0.0)
        outcome, caught = _raise_from_another_thread(raiser, blocked_in=lambda: blocked)
        assert caught is None and outcome is not None and not outcome.done
        assert outcome.why.startswith("the main thread is blocked in C++ (all_reduce(SUM) #3)")
    finally:
        raiser.uninstall()


def test_abort_calls_abort_on_every_process_group():
    assert Abort()(IncidentRef(DOC, Path(".")), ctx()) == Outcome(done=False, why="no process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        name = dist.distributed_c10d._get_default_group().group_name
        outcome = Abort()(IncidentRef(DOC, Path(".")), ctx())
        assert outcome == Outcome(done=True, details={"aborted": [name], "failed": []})
    finally:
        dist.destroy_process_group()


def test_the_fence_waits_its_own_time_and_leaves_every_rank_but_the_culprit_alone():
    # Its wait comes from the rung itself, not from escalate_after_s.
    ladder = Ladder([Report(), Abort(), Fence(after_s=7.0)], escalate_after_s=1.0)
    state, ref = LadderState(), IncidentRef(DOC, Path("."))
    taken: list[str] = []

    def run(action, step):
        taken.append(action.name)
        return Outcome(done=True)

    ladder.start(state, 0.0, run)
    assert ladder.climb(state, 0.0, lambda: False, run) == "stepped"  # abort at once
    assert ladder.climb(state, 6.9, lambda: False, run) == "waiting"
    assert ladder.climb(state, 7.0, lambda: False, run) == "stepped" and taken == ["report", "abort", "fence"]
    # Alone after the report, it still waits its time.
    state = LadderState()
    Ladder([Report(), Fence(after_s=3.0)], 1.0).start(state, 10.0, run)
    assert state.deadline == 13.0
    # Not the culprit, or no report yet: nothing happens (the process goes on).
    note = MergedNote(host="h", dir="d", summary="s", culprits=[2, 3])
    assert Fence()(ref, ctx(rank=0, merged=lambda: note)) == Outcome(
        done=False, why="rank(s) 2-3 named the culprit; this rank is not fenced", details={"culprits": [2, 3]}
    )
    none = MergedNote(host="h", dir="d", summary="s")
    assert Fence()(ref, ctx(merged=lambda: none)).why == "no culprit named; this rank is not fenced"
    assert Fence()(ref, ctx()).why == "no merged report in the store yet: no rank is named the culprit"
    with pytest.raises(ValueError, match="after_s must be > 0 seconds, got 0"):
        Fence(after_s=0)


def test_the_fence_saves_its_rung_marks_the_rank_and_exits_0(tmp_path):
    script = f"""
import json, pathlib
from ncclguard.watching.ladder.actions import ActionContext, Fence, IncidentRef
from ncclguard.incidents.model import IncidentDoc, MergedNote
from ncclguard.watching.base.settings import WatchdogConfig
doc = IncidentDoc(kind="hang", reason="r", id="x-003")
save = lambda o: pathlib.Path({str(tmp_path / "saved.json")!r}).write_text(json.dumps([o.done, o.details]))
note = MergedNote(host="h", dir="d", summary="s", culprits=[1])
ctx = ActionContext(WatchdogConfig(), 1, None, None, lambda: None, save, merged=lambda: note, mark_fenced=lambda: True)
Fence()(IncidentRef(doc, pathlib.Path(".")), ctx)
raise SystemExit(9)  # not reached
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tmp_path / "saved.json").read_text())
    assert saved == [True, {"fenced": True, "code": 0, "marked": True, "culprits": [1]}]


def test_exit_saves_its_rung_then_ends_the_process_with_its_code(tmp_path):
    script = f"""
import json, pathlib, time
from ncclguard.watching.ladder.actions import ActionContext, Exit, IncidentRef
from ncclguard.incidents.model import IncidentDoc
from ncclguard.watching.base.settings import WatchdogConfig
doc = IncidentDoc(kind="hang", reason="r", id="x-002")
save = lambda o: pathlib.Path({str(tmp_path / "saved.json")!r}).write_text(json.dumps([o.done, o.details]))
for exit in (Exit(), Exit(9)):
    cfg = WatchdogConfig(exit_code=33)
    exit(IncidentRef(doc, pathlib.Path(".")), ActionContext(cfg, 0, None, None, lambda: None, save))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 33, proc.stderr  # the config's code; the second Exit never ran
    assert json.loads((tmp_path / "saved.json").read_text()) == [True, {"code": 33}]


def test_a_custom_rung_fires_in_a_real_watchdog_thread(tmp_path):
    """A world of one (no process group): a synthetic op left in flight is a hang; the ladder
    report -> note -> note climbs with escalate_after_s between the two notes."""
    note = Note()
    wd = Watchdog(
        heartbeat_s=0.1, hang_timeout_s=0.3, escalate_after_s=0.2, incident_dir=tmp_path, actions=[note, note]
    )
    assert wd.ladder.names == ("report", "note", "note")
    rec = recorder.start("all_reduce(SUM)", "custom-test", 4, "float32", site="/job/t.py:1")
    try:
        wd.start()
        (inc,) = wd.wait_for_incident(30, settled=True)  # a hang guard: settled in about a second
    finally:
        recorder.finish(rec)
        wd.stop()
        recorder.clear()  # the synthetic group's counter and record
    assert [(a["rung"], a["done"]) for a in inc["actions"]] == [("report", True), ("note", True), ("note", True)]
    assert note.seen == [(inc["id"], 0), (inc["id"], 0)]
    times = [a["time"] for a in inc["actions"]]
    assert times[2] - times[1] >= 0.2
    dump = json.loads((Path(inc["dir"]) / "rank0.json").read_text())
    assert dump["ladder"] == ["report", "note", "note"] and dump["actions"] == inc["actions"]
    assert (Path(inc["dir"]) / "incident.json").is_file()
