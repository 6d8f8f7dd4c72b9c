"""Above 1,024 ranks a merge reads every rank's head (``Statement.head``) and the whole statements
of the culprits and of a few victims only (``watching/desk/merging.py``; benchmarks/desk_scale.py:
parsing 16,384 whole statements took the merging rank 3.6 s, their heads 0.35 s)."""

from __future__ import annotations

import json
import logging
import threading
import time

import torch.distributed as dist
from desk_kit import QuietState
from hypothesis import given
from hypothesis import strategies as st

from ncclguard.errors import StoreTimeout
from ncclguard.incidents.analysis import analyse, site_function
from ncclguard.incidents.beats import site_frames
from ncclguard.incidents.model import (
    BackendOp,
    Heartbeat,
    IncidentKind,
    OpRecord,
    PeerView,
    Statement,
)
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import BRIEF_FRAMES, BRIEF_FROM, BRIEF_RECENT, LIMITS, Keys, WatchdogStore
from ncclguard.watching.desk import merging
from ncclguard.watching.desk.cases import stale_from_statements
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.watching.ladder.actions import Ladder, build_ladder
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.liveness import Liveness

WORLD = BRIEF_FROM + 8  # 1,032 ranks, 8 a node: just past the size that reads heads first
TOP = 90_211  # the world group's op every rank but the culprit waits in
CULPRIT = WORLD // 3
BAD = (900, 901, 1000)  # ranks whose head in the store is hostile
NOW = time.time()

_files = st.sampled_from(["/job/train.py", "/job/model.py", "/lib/torch/nn/module.py"])
_frames = st.builds(
    lambda f, line, fn: f"{f}:{line} in {fn}: x = 1",
    _files,
    st.integers(1, 4),
    st.sampled_from(["step", "forward", "_call_impl"]),
)


@given(st.lists(_frames, max_size=12), _files, st.integers(1, 4))
def test_a_heads_frames_name_the_same_function_at_its_site_as_the_whole_stack(stack, path, line):
    site = f"{path}:{line}"
    kept = site_frames(stack, site)
    assert site_function(kept, site) == site_function(stack, site)
    assert len(kept) <= 2 and all(f in stack for f in kept)


def _op(seq: int, *, state: str = "completed", site: str = "/job/train.py:412", **fields: object) -> OpRecord:
    return OpRecord(
        seq=seq,
        op=str(fields.pop("op", "all_reduce(SUM)")),
        group=str(fields.pop("group", "0")),
        numel=int(fields.pop("numel", 26_214_400)),  # type: ignore[call-overload]
        dtype="torch.bfloat16",
        start=NOW - (TOP - seq) * 0.4 - 30,
        state=state,
        phase="eval batch=7" if "eval" in site else "train step=4821",
        site=site,
        **fields,  # type: ignore[arg-type]
    )


def said(rank: int, world: int = WORLD, *, behind: int = CULPRIT, **update: object) -> Statement:
    """What ``rank`` of a data- and tensor-parallel job says on a desync at #TOP of the world group:
    ``behind`` is one op short, in its evaluation; the site's frame is not the innermost one."""
    late = rank == behind
    seq = TOP - 1 if late else TOP
    site = "/job/eval.py:88" if late else "/job/train.py:412"
    stack = [f"/lib/torch/nn/modules/module.py:{1700 + i} in _call_impl: return f(x)" for i in range(12)]
    stack.insert(4, f"{site} in {'evaluate' if late else 'train_step'}: loss = model(batch)")
    inflight = [] if late else [_op(TOP, state="started", site=site)]
    st_ = Statement(
        rank=rank,
        host=f"gpu-node-{rank // 8:04d}",
        pid=4000 + rank,
        beat=91,
        time=NOW,
        phase="eval batch=7" if late else "train step=4821",
        site=site,
        last_seq={"0": seq, "1": 4_400},
        last_completed={"0": TOP - 1, "1": 4_400},
        inflight=inflight,
        blocked_in=inflight[0] if inflight else None,
        backend_seq={"0": seq, "1": 4_400},
        world_size=world,
        stack=stack,
        recent=[_op(TOP - 20 + i, site=site) for i in range(20)],
        groups={"0": [f"0:{world}:1"], "1": [f"{rank % 8}:{world + rank % 8}:8"]},  # as runs (beats.compact_ranks)
        peers={str((rank + i) % world): PeerView(age_s=0.8, stale=False, seen=True) for i in range(1, 17)},
        backend_ops={"0": BackendOp(seq=seq, name="gloo:allreduce", sizes=[[26_214_400]], dtypes=["BFloat16"])},
        readings={"gpu": {"util": 97.0, "mem_gb": 61.2}},
    )
    return st_.model_copy(update=update)


def _analysed(statements: dict[int, Statement], heartbeats: dict[int, Heartbeat], world: int) -> dict:
    stale = stale_from_statements({}, statements)
    got = analyse(statements, heartbeats, stale, world, now=NOW, waiting_after_s=5.0, focus=("0", TOP))
    return got.model_dump() | {"stale": stale}


def test_the_analysis_of_heads_is_the_analysis_of_whole_statements_for_each_kind_of_culprit():
    """A head keeps all of a statement that the analysis reads: the same findings, culprits (with
    their phase, site and function), victims and summary, for a rank behind, ops that do not match,
    a receive with nobody sending, a peer that others found stale, and a backend desync."""
    world = 64
    cases: dict[str, dict[int, Statement]] = {"behind": {r: said(r, world, behind=21) for r in range(world)}}
    odd = {r: said(r, world, behind=-1) for r in range(world)}
    odd[5] = odd[5].model_copy(update={"inflight": [_op(TOP, state="started", numel=1_024)]})
    cases["mismatch"] = odd
    recv = {r: said(r, world, behind=-1) for r in range(world)}
    wait = _op(77, state="started", op="recv", group="1", peer=9, numel=1_024)
    recv[3] = recv[3].model_copy(update={"inflight": [*recv[3].inflight, wait]})
    cases["p2p"] = recv
    lost = {r: said(r, world, behind=-1) for r in range(world) if r != 40}
    lost[39] = lost[39].model_copy(update={"peers": {"40": PeerView(age_s=31.0, stale=True, seen=True)}})
    cases["lost"] = lost
    for name, whole in cases.items():
        heads = {r: s.head() for r, s in whole.items()}
        assert all(
            len(h.model_dump_json()) < len(s.model_dump_json()) / 3
            for h, s in zip(heads.values(), whole.values(), strict=True)
        )
        assert _analysed(heads, {}, world) == _analysed(whole, {}, world), name
    named = _analysed({r: s.head() for r, s in cases["behind"].items()}, {}, world)
    assert [(c["rank"], c["why"], c["func"], c["site"]) for c in named["culprits"]] == [
        (21, "behind", "evaluate", "/job/eval.py:88")
    ]
    assert [c["rank"] for c in _analysed({r: s.head() for r, s in cases["lost"].items()}, {}, world)["culprits"]] == [
        40
    ]
    backend = {r: said(r, world, behind=21, inflight=[], blocked_in=None) for r in range(world)}
    heads = {r: s.head() for r, s in backend.items()}
    for statements in (backend, heads):
        got = analyse(statements, {}, {}, world, now=NOW, backend_group="0")
        assert [(c.rank, c.why) for c in got.culprits] == [(21, "behind")]
    assert analyse(heads, {}, {}, world, now=NOW, backend_group="0") == analyse(
        backend, {}, {}, world, now=NOW, backend_group="0"
    )


class Reads:
    """A HashStore whose ``multi_get`` keys are counted by their kind (``st``, ``head``, ``hb``)."""

    def __init__(self) -> None:
        self.inner, self.keys = dist.HashStore(), {}

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)
        if name != "multi_get":
            return method

        def call(keys):
            for k in keys:
                kind = k.split("/")[-2]
                self.keys[kind] = self.keys.get(kind, 0) + 1
            return method(keys)

        return call


def _merge(tmp_path, reads: Reads, *, hostile: bool = True) -> tuple[dict, IncidentDesk]:
    """Rank 0's desk merges a desync of WORLD ranks whose other ranks' statements are in the store."""
    store = WatchdogStore(reads, Keys("t"), 30.0, 60.0)
    for r in range(1, WORLD):
        store.put_statement(1, said(r))
    if hostile:
        keys = Keys("t")
        # Each refused, its rank's last heartbeat stands for it (a rank that said nothing readable
        # and never beat would be named behind, at #0).
        reads.inner.set(keys.head(1, BAD[0]), "not json")
        reads.inner.set(keys.head(1, BAD[1]), reads.inner.get(keys.head(1, BAD[1] + 1)))  # the next rank's head
        reads.inner.set(keys.head(1, BAD[2]), "x" * (LIMITS[Statement] + 1))
        for r in BAD:
            store.publish_heartbeat(Heartbeat.model_validate(dict(said(r).head())))
    store.add_dumped(1, WORLD - 1)
    config = WatchdogConfig(heartbeat_s=0.1, hang_timeout_s=1, incident_dir=tmp_path)
    desk = IncidentDesk(
        config,
        QuietState(0, WORLD),
        Liveness(0, WORLD, 16, config.peer_timeout, config.startup_grace_s),
        Ladder(build_ladder("report"), config.escalate_after_s),
        None,
        lambda: said(0),
        threading.Condition(),
    )
    desk.store = store
    desk.open(Detection(IncidentKind.HANG, "rank 0 waited 30 s", f"hang/0/{TOP}", group="0", seq=TOP, op="all_reduce"))
    desk.poll()
    desk.progress()
    assert desk.cases[0].merged
    return json.loads((tmp_path / desk.cases[0].doc.id / "incident.json").read_text()), desk


def test_above_1024_ranks_the_merge_reads_heads_and_the_culprits_whole_statements(tmp_path, caplog):
    reads = Reads()
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        inc, desk = _merge(tmp_path, reads)
    assert [(c["rank"], c["why"], c["phase"], c["func"]) for c in inc["culprits"]] == [
        (CULPRIT, "behind", "eval batch=7", "evaluate")
    ]
    assert inc["silent"] == list(BAD) and inc["statements_from"] == [r for r in range(WORLD) if r not in BAD]
    views = inc["ranks"]
    assert [views[str(r)]["source"] for r in BAD] == ["heartbeat"] * 3
    whole = [CULPRIT, *range(merging.WHOLE_VICTIMS)]
    assert sorted(r for r, v in views.items() if v["source"] == "statement") == sorted(map(str, whole))
    assert sum(v["source"] == "head" for v in views.values()) == WORLD - 3 - len(whole)
    # The culprit's whole statement as stored (brief above 1,024 ranks); rank 0's own as it made it.
    culprit = views[str(CULPRIT)]
    assert (len(culprit["stack"]), len(culprit["recent"]), len(culprit["peers"])) == (BRIEF_FRAMES, BRIEF_RECENT, 16)
    assert (len(views["0"]["stack"]), len(views["0"]["recent"]), views["0"]["readings"]) == (
        13,
        20,
        {"gpu": {"util": 97.0, "mem_gb": 61.2}},
    )
    head = views["100"]
    assert (head["recent"], head["peers"], head["readings"]) == ([], {}, None)
    assert head["stack"] == ["/job/train.py:412 in train_step: loss = model(batch)"]
    # Read: every head, the heartbeats of the 3 ranks with none, the whole statements of the chosen
    # ranks but rank 0 (its own is at hand); no other statement.
    assert reads.keys == {"head": WORLD, "hb": 3, "st": len(whole) - 1}, reads.keys
    bad = [m for m in caplog.messages if "ignored a value" in m]
    assert len(bad) == 3 and all(any(f"/head/{r}" in m for m in bad) for r in BAD), bad
    summary = (tmp_path / desk.cases[0].doc.id / "summary.txt").read_text()
    assert f"rank {CULPRIT}" in summary and "evaluate" in summary


def test_a_merge_whose_whole_statements_cannot_be_read_writes_its_report_from_the_heads(tmp_path, monkeypatch):
    """The culprit is still named, with its phase, site and function; its view says it is a head."""

    def slow(*_: object) -> None:
        raise StoreTimeout("the store did not answer in 30 s")

    monkeypatch.setattr(WatchdogStore, "read_statements", slow)
    inc, _ = _merge(tmp_path, Reads(), hostile=False)
    assert [(c["rank"], c["why"], c["func"]) for c in inc["culprits"]] == [(CULPRIT, "behind", "evaluate")]
    assert inc["ranks"][str(CULPRIT)]["source"] == "head" and inc["ranks"]["0"]["source"] == "statement"
    assert inc["silent"] == []
