"""The typed incident model and its file format: version-1 files written by the old watchdog
(tests/fixtures/incidents_v1, real ranks) still read and render the same; version 2 round-trips;
the JSON schema is printed; what is not an incident is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from ncclguard.cli import main
from ncclguard.incidents.beats import compact_ranks, expand_ranks
from ncclguard.incidents.files import load, write_json
from ncclguard.incidents.model import (
    FORMAT_VERSION,
    CulpritReason,
    FindingKind,
    Incident,
    IncidentKind,
    LostRanksFinding,
    RankDump,
    Statement,
    upgrade_incident,
    upgrade_rank_dump,
)
from ncclguard.incidents.render import render

V1 = Path(__file__).parents[1] / "fixtures" / "incidents_v1"
DESYNC = V1 / "20261122-090619-001"
LOST = V1 / "20261122-090631-002"


@pytest.mark.parametrize("where", [DESYNC, LOST], ids=["desync", "lost"])
def test_version_1_incidents_read_and_render_as_the_old_code_did(where):
    raw = json.loads((where / "incident.json").read_text())
    assert raw["version"] == 1 and "format_version" not in raw
    incident, found, merged_here = load(where)
    assert (found, merged_here, incident.format_version) == (where, False, FORMAT_VERSION)
    assert render(incident) == (where / "summary.txt").read_text()


def test_the_version_1_desync_reads_typed():
    incident = upgrade_incident(json.loads((DESYNC / "incident.json").read_text()))
    assert incident.incident.kind is IncidentKind.HANG and incident.incident.op_key == ("0", 15)
    (finding,) = incident.findings
    assert finding.kind is FindingKind.DESYNC and finding.waiting == [0, 1]
    (culprit,) = incident.culprits
    assert (culprit.rank, culprit.why, culprit.last_completed, culprit.phase) == (
        2,
        CulpritReason.BEHIND,
        14,
        "eval batch=7",
    )
    assert incident.ranks["2"].source == "statement" and incident.ranks["2"].stack


def test_version_1_lost_rank_counters_move_to_last_completed_by_group():
    incident = upgrade_incident(json.loads((LOST / "incident.json").read_text()))
    assert incident.incident.kind is IncidentKind.PEERS_LOST and incident.incident.ranks == [3]
    (culprit,) = incident.culprits
    assert (culprit.why, culprit.last_completed, culprit.last_completed_by_group) == (
        CulpritReason.STOPPED_BEATING,
        None,
        {"0": 1},
    )
    (finding,) = incident.findings
    assert isinstance(finding, LostRanksFinding) and finding.ranks[0].last_completed_by_group == {"0": 1}
    assert incident.stale_ranks == [3]
    # Written back as version 2: the same words on disk ("lost", "why"), the dict under its own name.
    out = incident.to_json()
    assert (out["format_version"], out["lost"], out["culprits"][0]["why"]) == (2, [3], "lost")
    assert out["culprits"][0]["last_completed"] is None and "version" not in out
    assert upgrade_incident(out) == incident


def test_version_1_rank_dumps_alone_are_merged_by_the_report(tmp_path, capsys):
    where = tmp_path / DESYNC.name
    shutil.copytree(DESYNC, where)
    (where / "incident.json").unlink()
    incident, _, merged_here = load(where)
    assert merged_here and incident.merged_by == -1 and incident.statements_from == [0, 1, 2]
    assert [(c.rank, c.why) for c in incident.culprits] == [(2, CulpritReason.BEHIND)]
    dump = upgrade_rank_dump(json.loads((where / "rank0.json").read_text()))
    assert dump.format_version == 2 and dump.actions[0].rung == "report"
    assert main(["report", str(where)]) == 0
    assert "rank 2 last completed #14, now in phase eval batch=7" in capsys.readouterr().out


def test_report_json_prints_version_2_of_a_version_1_file(capsys):
    assert main(["report", "--json", str(DESYNC)]) == 0
    out = json.loads(capsys.readouterr().out)
    old = json.loads((DESYNC / "incident.json").read_text())
    assert out["format_version"] == 2 and "version" not in out
    assert (out["summary"], out["victims"], out["incident"]["id"]) == (
        old["summary"],
        old["victims"],
        old["incident"]["id"],
    )


def test_report_schema_names_both_files(capsys):
    assert main(["report", "--schema"]) == 0
    schemas = json.loads(capsys.readouterr().out)
    assert set(schemas) == {"ncclguard-incident", "ncclguard-rank-dump"}
    incident = schemas["ncclguard-incident"]
    assert incident["properties"]["format_version"]["const"] == 2
    assert {"findings", "culprits", "victims", "lost", "ranks"} <= set(incident["properties"])
    assert schemas["ncclguard-rank-dump"] == RankDump.model_json_schema()


def test_version_2_round_trips_through_the_files(tmp_path):
    incident = upgrade_incident(json.loads((DESYNC / "incident.json").read_text()))
    where = tmp_path / "x"
    write_json(where / "incident.json", incident)
    again, _, _ = load(where)
    assert again == incident and json.loads((where / "incident.json").read_text())["format_version"] == 2


@pytest.mark.parametrize(
    "raw, phrase",
    [
        ({"kind": "something-else"}, "is not an ncclguard incident (kind='something-else')"),
        ([1, 2], "is not an ncclguard incident (kind='list')"),
        (
            {"kind": "ncclguard-incident", "format_version": 3},
            "format version 3; this ncclguard reads versions 1 and 2",
        ),
    ],
)
def test_what_is_not_an_incident_is_refused_with_the_reason(raw, phrase):
    with pytest.raises(ValueError) as info:
        upgrade_incident(raw, "f.json")
    assert phrase in str(info.value) and str(info.value).startswith("f.json ")


def test_a_malformed_incident_names_the_field(tmp_path, capsys):
    raw = json.loads((DESYNC / "incident.json").read_text())
    raw["culprits"][0]["why"] = "bored"
    with pytest.raises(ValidationError, match="culprits.0.why"):
        upgrade_incident(raw)
    (tmp_path / "incident.json").write_text(json.dumps(raw))
    assert main(["report", str(tmp_path)]) == 2
    assert "culprits.0.why" in capsys.readouterr().out


def test_a_file_cut_short_says_so(tmp_path, capsys):
    (tmp_path / "incident.json").write_text((DESYNC / "incident.json").read_text()[:500])
    assert main(["report", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "is not valid JSON" in out and "was it cut short?" in out


def test_enum_values_are_the_words_on_disk():
    assert [k.value for k in IncidentKind] == [
        "hang",
        "desync",
        "lost",
        "store",
        "stuck",
        "straggler",
        "sensor",
        "numerics",
    ]
    assert [k.value for k in CulpritReason] == ["behind", "mismatch", "p2p", "lost"]
    assert {k.value for k in FindingKind} == {"desync", "stuck", "mismatch", "p2p", "lost", "silent", "store"}
    assert Incident.model_fields["stale_ranks"].alias == "lost"


@given(st.lists(st.integers(0, 5000), max_size=300, unique=True).map(sorted))
def test_a_groups_ranks_written_as_runs_read_back_as_they_were(ranks):
    assert expand_ranks(compact_ranks(ranks)) == ranks


def test_a_statement_of_16384_ranks_writes_its_groups_as_runs_and_reads_them_back():
    """benchmarks/desk_scale.py: a statement carrying its world's and its data-parallel group's
    ranks was ~100 KB at 16,384 ranks, and a merging rank holding 16,384 of them as lists ran out of
    24 GB; kept as runs, its groups take a few bytes. A short group stays a plain list, as files
    from before read."""
    groups = {"0": list(range(16384)), "1": list(range(3, 16384, 8)), "2": list(range(8, 16))}
    fields = dict(rank=3, host="n", pid=1, beat=1, time=0.0, phase="", site="", last_seq={}, last_completed={})
    st16k = Statement(**fields, inflight=[], groups=groups)
    text = st16k.model_dump_json()
    assert json.loads(text)["groups"] == {"0": ["0:16384:1"], "1": ["3:16387:8"], "2": list(range(8, 16))}
    back = Statement.model_validate_json(text)
    assert len(text) < 1000 and {g: back.members(g) for g in groups} == groups and back.members("9") is None
    # Kept as runs in memory too: a merging rank holds 16,384 statements.
    assert st16k.groups == back.groups == json.loads(text)["groups"]
    for bad in (["1:0:1"], ["0:8:0"], ["a"], [True], [f"0:{(1 << 20) + 1}:1"], [[1]]):
        with pytest.raises(ValidationError):
            Statement(**fields, inflight=[], groups={"0": bad})
