"""Incidents on disk: the per-rank dumps, the merged ``incident.json``, and the plain-text report.

The watchdog (:mod:`ncclguard.diagnosis.watchdog`) writes ``<incident_dir>/<id>/rank<r>.json`` on every rank
it can reach, and one surviving rank merges the ranks' statements into ``incident.json`` and
``summary.txt``. This module holds the parts that need no process group: the culprit analysis,
the merge, the rendering, and loading an incident back (``python -m ncclguard report DIR``).

The analysis, per process group with an op in flight for longer than ``waiting_after_s``:
the ranks waiting at the group's highest sequence number are the victims; a member whose last
sequence number is lower is elsewhere (a culprit: its phase, main-thread call site and any op it
is in are reported); a member whose heartbeat went stale is lost; waiting ranks that disagree on
the op, size or dtype at the same number are a mismatch; everyone waiting at the same number
with the same op is a stuck transport, not a desync.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "INCIDENT_FILE",
    "SUMMARY_FILE",
    "analyse",
    "find_incident",
    "load_incident",
    "merge",
    "rank_ranges",
    "render",
    "write_json",
]

INCIDENT_FILE = "incident.json"
SUMMARY_FILE = "summary.txt"
FORMAT_VERSION = 1


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 3, 5, 6, 7]`` -> ``"0-1,3,5-7"``."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def _short_site(site: str) -> str:
    """``/long/path/eval.py:88`` -> ``eval.py:88`` for the one-line summary."""
    return os.path.basename(site) if site else "?"


def _phase_text(phase: str) -> str:
    return f"phase {phase}" if phase else "no phase set"


def _op_text(rec: dict[str, Any], with_group: bool = True) -> str:
    group = f" on group {rec['group']}" if with_group and rec.get("group") not in (None, "0") else ""
    return f"{rec['op']} #{rec['seq']}{group}"


def write_json(path: Path, doc: Any) -> None:
    """Writes ``doc`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def _view(
    rank: int, statements: dict[int, dict[str, Any]], heartbeats: dict[int, dict[str, Any]]
) -> dict[str, Any] | None:
    """What is known of ``rank``: its statement, else its last heartbeat, else None."""
    if rank in statements:
        return {**statements[rank], "source": "statement"}
    if rank in heartbeats:
        return {**heartbeats[rank], "source": "heartbeat"}
    return None


def _members(group: str, views: dict[int, dict[str, Any]], world_size: int) -> list[int]:
    for view in views.values():
        ranks = (view.get("groups") or {}).get(group)
        if ranks:
            return sorted(ranks)
    if group == "0":
        return list(range(world_size))
    return sorted(r for r, v in views.items() if group in (v.get("last_seq") or {}))


def _where_now(rank: int, view: dict[str, Any] | None, exclude: tuple[str, int] | None = None) -> dict[str, Any]:
    """A rank's whereabouts: phase, main-thread site, and the op it is in (other than ``exclude``)."""
    if view is None:
        return {"rank": rank, "phase": "", "site": "?", "inflight": None, "host": None, "pid": None}
    inflight = None
    candidates = ([view["blocked_in"]] if view.get("blocked_in") else []) + list(view.get("inflight") or [])
    for rec in candidates:
        if exclude is None or (rec["group"], rec["seq"]) != exclude:
            inflight = rec
            break
    return {
        "rank": rank,
        "phase": view.get("phase", ""),
        "site": view.get("site", "?"),
        "inflight": inflight,
        "host": view.get("host"),
        "pid": view.get("pid"),
    }


def _now_text(where: dict[str, Any], lead: str = "now in") -> str:
    rec = where["inflight"]
    if rec is not None:
        return f"{lead} {_op_text(rec)} ({_phase_text(rec.get('phase', ''))}) at {_short_site(rec.get('site', ''))}"
    return f"{lead} {_phase_text(where['phase'])} at {_short_site(where['site'])}"


def _last_text(entry: dict[str, Any]) -> str:
    if not entry.get("last_seq"):
        return "issued nothing on this group yet"
    if entry.get("last_completed") == entry.get("last_seq"):
        return f"last completed #{entry['last_completed']}"
    return f"last completed #{entry.get('last_completed')}, last issued #{entry['last_seq']}"


def _grouped(entries: list[dict[str, Any]], describe: Any) -> list[str]:
    """One phrase per distinct description, naming all the ranks it fits ("ranks 1-2 ...")."""
    by_text: dict[str, list[int]] = {}
    for e in entries:
        by_text.setdefault(describe(e), []).append(e["rank"])
    return [f"{_ranks_text(ranks)} {text}" for text, ranks in by_text.items()]


def analyse(
    statements: dict[int, dict[str, Any]],
    heartbeats: dict[int, dict[str, Any]],
    stale: dict[int, float],
    world_size: int,
    *,
    now: float | None = None,
    waiting_after_s: float = 0.0,
    focus: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Names culprits and victims from what the ranks said.

    Args:
        statements: each answering rank's statement (see :mod:`ncclguard.diagnosis.watchdog`), by rank.
        heartbeats: the last heartbeat seen of each rank, by rank (used where no statement came).
        stale: ranks whose heartbeat stopped, with seconds since it last changed.
        world_size: ranks in the job.
        now: the time of the analysis (``time.time()``); default now.
        waiting_after_s: an op counts as stuck once in flight this long.
        focus: ``(group, seq)`` of the op that raised the incident: always analysed.

    Returns:
        ``{"findings": [...], "culprits": [...], "victims": [...], "lost": [...], "summary": str}``.
    """
    now = time.time() if now is None else now
    views = {r: v for r in range(world_size) if (v := _view(r, statements, heartbeats)) is not None}
    lost = sorted(r for r in stale if r < world_size)
    silent = sorted(r for r in range(world_size) if r not in statements and r not in stale)
    findings: list[dict[str, Any]] = []
    culprits: dict[int, dict[str, Any]] = {}
    victims: set[int] = set()

    # The groups with an op stuck somewhere, oldest in-flight op per rank.
    oldest: dict[str, dict[int, dict[str, Any]]] = {}
    p2p_waits: list[tuple[int, dict[str, Any]]] = []
    for r, view in views.items():
        if r in stale:
            continue  # a lost rank's last heartbeat is old news: it is a culprit, not a witness
        taken = view.get("time", now)
        for rec in view.get("inflight") or []:
            if rec.get("peer") is not None:  # send/recv: counts differ between ranks, matched by peer below
                if taken - rec["start"] >= waiting_after_s:
                    p2p_waits.append((r, rec))
                continue
            mine = oldest.setdefault(rec["group"], {})
            if r not in mine or rec["seq"] < mine[r]["seq"]:
                mine[r] = {**rec, "age_s": round(taken - rec["start"], 3)}
    problem = [
        g
        for g, recs in oldest.items()
        if any(rec["age_s"] >= waiting_after_s for rec in recs.values()) or (focus is not None and focus[0] == g)
    ]

    for group in sorted(problem):
        recs = oldest.get(group, {})
        if not recs:
            continue
        top = max(rec["seq"] for rec in recs.values())
        at_top = {r: rec for r, rec in recs.items() if rec["seq"] == top}
        members = _members(group, views, world_size)
        shapes = Counter((rec["op"], rec["numel"], rec["dtype"]) for rec in at_top.values())
        first = at_top[min(at_top)]
        waiting_s = round(max(now - rec["start"] for rec in at_top.values()), 1)
        base = {
            "group": group,
            "seq": top,
            "op": first["op"],
            "numel": first["numel"],
            "dtype": first["dtype"],
            "phase": first.get("phase", ""),
            "site": first.get("site", ""),
            "waiting_s": waiting_s,
        }
        if len(shapes) > 1:
            variants = []
            for shape, count in shapes.most_common():
                ranks = sorted(r for r, rec in at_top.items() if (rec["op"], rec["numel"], rec["dtype"]) == shape)
                variants.append(
                    {
                        "ranks": ranks,
                        "op": shape[0],
                        "numel": shape[1],
                        "dtype": shape[2],
                        "site": at_top[ranks[0]].get("site", ""),
                        "phase": at_top[ranks[0]].get("phase", ""),
                    }
                )
            majority = (
                variants[0]["ranks"]
                if variants[0]["ranks"] and len(variants[0]["ranks"]) > len(variants[1]["ranks"])
                else []
            )
            odd = sorted(r for v in variants[1 if majority else 0 :] for r in v["ranks"])
            findings.append({"kind": "mismatch", **base, "variants": variants, "suspects": odd})
            for r in odd:
                culprits.setdefault(
                    r, {"rank": r, "why": "mismatch", "group": group, "seq": top, **_where_now(r, views.get(r))}
                )
            victims.update(r for r in at_top if r not in odd)
            continue
        behind, gone = [], []
        for r in members:
            if r in at_top:
                continue
            view = views.get(r)
            last = (view or {}).get("last_seq", {}).get(group, 0)
            done = (view or {}).get("last_completed", {}).get(group, 0)
            entry = {"last_seq": last, "last_completed": done, **_where_now(r, view, exclude=(group, top))}
            if r in stale:
                gone.append({**entry, "stale_s": round(stale[r], 1)})
            elif view is None or last < top:
                behind.append(entry)
            # else: it issued #top already and is not waiting in it: not the one holding the others up
        victims.update(at_top)
        if not behind and not gone:
            findings.append({"kind": "stuck", **base, "waiting": sorted(at_top)})
            continue
        findings.append({"kind": "desync", **base, "waiting": sorted(at_top), "behind": behind, "lost": gone})
        for entry in behind:
            culprits.setdefault(entry["rank"], {"why": "behind", "group": group, "seq": top, **entry})
        for entry in gone:
            culprits.setdefault(entry["rank"], {"why": "lost", "group": group, "seq": top, **entry})

    for r, rec in sorted(p2p_waits, key=lambda w: (w[0], w[1]["seq"])):
        peer = rec["peer"]
        peer_view = views.get(peer) if peer not in stale else None
        back = [p for p in (peer_view or {}).get("inflight") or [] if p.get("peer") == r]
        finding = {
            "kind": "p2p",
            "rank": r,
            "op": rec["op"],
            "group": rec["group"],
            "seq": rec["seq"],
            "peer": peer,
            "numel": rec["numel"],
            "dtype": rec["dtype"],
            "phase": rec.get("phase", ""),
            "site": rec.get("site", ""),
            "waiting_s": round(now - rec["start"], 1),
            "peer_waits_back": back[0] if back else None,
            "peer_where": _where_now(peer, peer_view),
        }
        findings.append(finding)
        victims.add(r)
        if peer >= 0 and peer not in stale and not back:
            culprits.setdefault(
                peer,
                {
                    "why": "p2p",
                    "group": rec["group"],
                    "seq": rec["seq"],
                    "waiter": r,
                    "waiter_op": rec["op"],
                    **_where_now(peer, peer_view),
                },
            )

    missing_lost = [r for r in lost if r not in culprits]
    if missing_lost:
        entries = []
        for r in missing_lost:
            entry = {"stale_s": round(stale[r], 1), **_where_now(r, views.get(r))}
            view = views.get(r) or {}
            entry["last_completed"] = view.get("last_completed", {})
            entries.append(entry)
            culprits[r] = {"why": "lost", **entry}
        findings.append({"kind": "lost", "ranks": entries})
        if not victims:
            victims.update(r for r in range(world_size) if r not in culprits)
    if silent:
        findings.append(
            {
                "kind": "silent",
                "ranks": silent,
                "note": "no statement came from these ranks (watchdog thread starved, e.g. the GIL held by C code)",
            }
        )
    victims.difference_update(culprits)
    summary = _one_line(findings)
    return {
        "findings": findings,
        "culprits": [culprits[r] for r in sorted(culprits)],
        "victims": sorted(victims),
        "lost": lost,
        "silent": silent,
        "summary": summary,
    }


def _one_line(findings: list[dict[str, Any]]) -> str:
    parts = []
    for f in findings:
        if f["kind"] in ("desync", "stuck", "mismatch"):
            head = (
                f"{_ranks_text(f.get('waiting') or [r for v in f.get('variants', []) for r in v['ranks']])} waiting in "
                f"{_op_text(f)} ({f['numel']} x {f['dtype'] or 'no data'}, {_phase_text(f['phase'])}) for {f['waiting_s']:.1f} s"
            )
            if f["kind"] == "stuck":
                parts.append(head + "; every member is there: a stuck transport, not a desync")
            elif f["kind"] == "mismatch":
                shapes = "; ".join(
                    f"{_ranks_text(v['ranks'])} in {v['op']} ({v['numel']} x {v['dtype']}) at {_short_site(v['site'])}"
                    for v in f["variants"]
                )
                parts.append(f"ranks disagree at {f['op']} #{f['seq']}: {shapes}")
            else:
                tails = _grouped(f["behind"], lambda b: f"{_last_text(b)}, {_now_text(b)}")
                tails += [
                    f"rank {b['rank']} lost (no heartbeat for {b['stale_s']:.1f} s), {_last_text(b)}" for b in f["lost"]
                ]
                parts.append("; ".join([head, *tails]))
        elif f["kind"] == "p2p":
            head = (
                f"rank {f['rank']} waiting in {f['op']} {'to' if 'send' in f['op'] else 'from'} rank {f['peer']} "
                f"({f['numel']} x {f['dtype']}, {_phase_text(f['phase'])}) for {f['waiting_s']:.1f} s"
            )
            back = f["peer_waits_back"]
            if back is not None:
                parts.append(f"{head}; rank {f['peer']} waits back in {back['op']}: a point-to-point deadlock")
            else:
                parts.append(f"{head}; rank {f['peer']} {_now_text(f['peer_where'])}")
        elif f["kind"] == "lost":
            for e in f["ranks"]:
                parts.append(
                    f"rank {e['rank']} lost: no heartbeat for {e['stale_s']:.1f} s, {_now_text(e, 'last seen in')}"
                )
        elif f["kind"] == "store":
            parts.append(f["text"])
    return "; ".join(parts) if parts else "no rank is stuck in a collective and every peer is alive"


def merge(
    doc: dict[str, Any],
    statements: dict[int, dict[str, Any]],
    heartbeats: dict[int, dict[str, Any]],
    stale: dict[int, float],
    world_size: int,
    *,
    merged_by: int,
    waiting_after_s: float,
    extra_findings: list[dict[str, Any]] | None = None,
    analyse_ranks: bool = True,
) -> dict[str, Any]:
    """Builds the merged incident (the content of ``incident.json``).

    Args:
        doc: the incident as raised (``id``, ``kind``, ``reason``, ``by``, ``created``, ...).
        statements, heartbeats, stale, world_size, waiting_after_s: see :func:`analyse`.
        merged_by: the rank that merges.
        extra_findings: findings known to the merger only (a lost store), each with a ``text``.
        analyse_ranks: False when the statements say nothing about the others (a lost store).
    """
    focus = (doc["group"], doc["seq"]) if doc.get("group") is not None and doc.get("seq") is not None else None
    if analyse_ranks:
        result = analyse(statements, heartbeats, stale, world_size, waiting_after_s=waiting_after_s, focus=focus)
    else:
        result = {"findings": [], "culprits": [], "victims": [], "lost": [], "silent": [], "summary": ""}
    if extra_findings:
        texts = [f["text"] for f in extra_findings] + ([result["summary"]] if result["findings"] else [])
        result["findings"] = extra_findings + result["findings"]
        result["summary"] = "; ".join(texts)
    ranks = {}
    for r in range(world_size):
        view = _view(r, statements, heartbeats)
        ranks[str(r)] = view if view is not None else {"source": "none"}
    return {
        "kind": "ncclguard-incident",
        "version": FORMAT_VERSION,
        "incident": doc,
        "written_at": time.time(),
        "merged_by": merged_by,
        "world_size": world_size,
        "statements_from": sorted(statements),
        "missing_statements": [r for r in range(world_size) if r not in statements],
        **result,
        "ranks": ranks,
    }


def _when(ts: float | None) -> str:
    if not ts:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"


def _culprit_key(c: dict[str, Any]) -> tuple[Any, ...]:
    rec = c.get("inflight") or {}
    return (
        c["why"],
        c.get("group"),
        c.get("seq"),
        c.get("last_seq"),
        c.get("last_completed") if c["why"] != "lost" else None,
        c.get("phase"),
        c.get("site"),
        rec.get("op"),
        rec.get("seq"),
        rec.get("group"),
    )


def _culprit_blocks(culprits: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Culprits that are in the same place, together (64 ranks in one eval loop read as one block)."""
    blocks: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in culprits:
        blocks.setdefault(_culprit_key(c), []).append(c)
    return list(blocks.values())


def render(incident: dict[str, Any], *, stack_lines: int = 8) -> str:
    """The merged incident as plain text for a tired human (also saved as ``summary.txt``)."""
    doc = incident["incident"]
    merged_by = incident["merged_by"]
    if doc.get("kind") == "store":
        source = f"written by rank {merged_by} alone (without the store the ranks cannot meet)"
    else:
        who = f"rank {merged_by}" if merged_by >= 0 else "`ncclguard report`"
        source = (
            f"merged by {who} from the statements of {len(incident['statements_from'])}/{incident['world_size']} ranks"
            + (
                f" (no statement from {_ranks_text(incident['missing_statements'])})"
                if incident["missing_statements"]
                else ""
            )
        )
    out = [
        f"ncclguard incident {doc['id']}: {doc.get('reason', doc.get('kind', ''))}",
        f"raised by rank {doc.get('by')} at {_when(doc.get('created'))}; {source}, at {_when(incident.get('written_at'))}",
        "",
        "IN ONE LINE",
        f"  {incident['summary']}",
        "",
    ]
    culprits = incident["culprits"]
    out.append("CULPRITS (not where the others are)" if culprits else "CULPRITS: none found")
    ranks = incident.get("ranks", {})
    for block in _culprit_blocks(culprits):
        c = block[0]
        hosts = sorted({f"{b['host']}:{b['pid']}" for b in block if b.get("host")})
        who = f"  {_ranks_text(b['rank'] for b in block)}" + (
            f" (host:pid {', '.join(hosts[:8])}{' ...' if len(hosts) > 8 else ''})" if hosts else ""
        )
        if c["why"] == "lost":
            stale = max(b.get("stale_s", 0.0) for b in block)
            out.append(f"{who}: LOST, no heartbeat for {stale:.1f} s (the process died, or froze holding the GIL)")
            out.append("      last seen:")
        elif c["why"] == "mismatch":
            out.append(f"{who}: called a different collective at #{c['seq']} on group {c['group']} than the others")
        elif c["why"] == "p2p":
            out.append(f"{who}: not in the matching send/recv; rank {c['waiter']} waits for it in {c['waiter_op']}")
        else:
            out.append(
                f"{who}: not in the collective the others wait in (#{c['seq']} on group {c['group']}); {_last_text(c)}"
            )
        rec = c.get("inflight")
        if rec:
            out.append(
                f"      in {_op_text(rec)}: {rec['numel']} x {rec['dtype'] or 'no data'}, {_phase_text(rec.get('phase', ''))}, "
                f"issued at {rec.get('site')}"
            )
        out.append(f"      {_phase_text(c.get('phase', ''))}, main thread at {c.get('site', '?')}")
        stack = (ranks.get(str(c["rank"])) or {}).get("stack") or []
        if stack:
            out.append(f"      main-thread stack of rank {c['rank']} (innermost last):")
            out.extend(f"        {line}" for line in stack[-stack_lines:])
    out.append("")
    victims = incident["victims"]
    out.append(f"VICTIMS (waiting for the culprits): {_ranks_text(victims) if victims else 'none'}")
    for f in incident["findings"]:
        if f["kind"] in ("desync", "stuck"):
            out.append(
                f"  {_ranks_text(f['waiting'])} in {_op_text(f)}: {f['numel']} x {f['dtype'] or 'no data'}, "
                f"{_phase_text(f['phase'])}, for {f['waiting_s']:.1f} s, issued at {f['site']}"
            )
        elif f["kind"] == "mismatch":
            for v in f["variants"]:
                out.append(
                    f"  {_ranks_text(v['ranks'])} in {v['op']} #{f['seq']}: {v['numel']} x {v['dtype'] or 'no data'}, "
                    f"{_phase_text(v['phase'])}, issued at {v['site']}"
                )
        elif f["kind"] == "silent":
            out.append(f"  no statement from {_ranks_text(f['ranks'])}: {f['note']}")
        elif f["kind"] == "p2p":
            out.append(
                f"  rank {f['rank']} in {f['op']} #{f['seq']} with rank {f['peer']}: {f['numel']} x {f['dtype']}, "
                f"{_phase_text(f['phase'])}, for {f['waiting_s']:.1f} s, issued at {f['site']}"
            )
    out.append("")
    out.append("WHAT TO DO")
    out.extend(f"  - {line}" for line in _advice(incident))
    out.append("")
    out.append("Per-rank dumps (all threads' stacks, flight records, heartbeats): rank<r>.json next to this file.")
    return "\n".join(out) + "\n"


def _advice(incident: dict[str, Any]) -> list[str]:
    tips = []
    kinds = {f["kind"] for f in incident["findings"]}
    for block in _culprit_blocks(incident["culprits"]):
        c, who = block[0], _ranks_text(b["rank"] for b in block)
        if c["why"] == "behind":
            tips.append(
                f"{who}: elsewhere while the others wait; read what the code does at {c.get('site', '?')} "
                f"({_phase_text(c.get('phase', ''))}). Usual causes: uneven evaluation shards, rank-0-only work "
                "(checkpoints, logging), a data stall, generate() without synced ranks, a collective inside an "
                "`if rank == ...`."
            )
        elif c["why"] == "lost":
            tips.append(
                f"{who}: stopped beating; check how that process ended (the launcher's log, `dmesg` for the OOM "
                "killer) on its host. The others cannot finish a collective without it."
            )
        elif c["why"] == "mismatch":
            tips.append(f"{who}: called a different op/size at the same point; the code paths diverged before it.")
        elif c["why"] == "p2p":
            tips.append(
                f"{who}: has not posted the send/recv its peer waits for; read what it does at {c.get('site', '?')} "
                "(pipeline stages out of step, or a condition that skips the transfer)."
            )
    if "stuck" in kinds:
        tips.append(
            "every member is in the same collective: not a desync. Suspect the network/transport "
            "(NCCL_DEBUG=INFO, `python -m ncclguard doctor`) or a GPU that stopped."
        )
    if "store" in kinds:
        tips.append(
            "the rendezvous store is gone: its host (rank 0 under a plain launcher, the agent under torchrun) "
            "died; look for that process's end first, the other ranks only followed it."
        )
    if not tips:
        tips.append("no culprit found: compare the ranks' stacks in the rank<r>.json files.")
    if kinds & {"desync", "stuck", "mismatch", "p2p"}:
        tips.append(
            "a backend timeout's NumelIn is what the waiting ranks queued, not proof that the transfer was slow."
        )
    return tips


def find_incident(path: str | os.PathLike[str]) -> Path:
    """The incident directory at ``path``: itself, or its newest incident subdirectory.

    Raises:
        FileNotFoundError: nothing that looks like an incident is there.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; pass an incident directory (the one holding rank*.json)")

    def is_incident(d: Path) -> bool:
        return (d / INCIDENT_FILE).is_file() or any(d.glob("rank*.json"))

    if is_incident(root):
        return root
    subs = sorted((d for d in root.iterdir() if d.is_dir() and is_incident(d)), key=lambda d: d.stat().st_mtime)
    if not subs:
        raise FileNotFoundError(f"no incident under {root}: expected incident.json or rank<r>.json files")
    return subs[-1]


def load_incident(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path, bool]:
    """Loads the merged incident at ``path``; merges the rank dumps there when no merge was written.

    Returns:
        (the merged incident, its directory, True when it was merged here from rank files).

    Raises:
        FileNotFoundError: no incident at ``path``.
        ValueError: a file there is not an ncclguard incident.
    """
    where = find_incident(path)
    merged = where / INCIDENT_FILE
    if merged.is_file():
        incident = json.loads(merged.read_text())
        if incident.get("kind") != "ncclguard-incident":
            raise ValueError(f"{merged} is not an ncclguard incident (kind={incident.get('kind')!r})")
        return incident, where, False
    dumps = {}
    for f in sorted(where.glob("rank*.json")):
        dump = json.loads(f.read_text())
        if dump.get("kind") != "ncclguard-rank-dump":
            raise ValueError(f"{f} is not an ncclguard rank dump (kind={dump.get('kind')!r})")
        dumps[dump["statement"]["rank"]] = dump
    any_dump = next(iter(dumps.values()))
    statements = {r: d["statement"] for r, d in dumps.items()}
    heartbeats: dict[int, dict[str, Any]] = {}
    stale: dict[int, float] = {}
    for d in dumps.values():
        for r, hb in (d.get("heartbeats") or {}).items():
            heartbeats.setdefault(int(r), hb)
        for r, peer in (d["statement"].get("peers") or {}).items():
            if peer.get("stale"):
                stale[int(r)] = max(stale.get(int(r), 0.0), peer.get("age_s", 0.0))
    world = any_dump["statement"].get("world_size", max(dumps) + 1)
    incident = merge(
        any_dump["incident"],
        statements,
        heartbeats,
        stale,
        world,
        merged_by=-1,
        waiting_after_s=any_dump.get("waiting_after_s", 0.0),
    )
    return incident, where, True
