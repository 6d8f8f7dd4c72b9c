"""Where the time of recording one collective goes, part by part (issue 29's breakdown).

    .venv/bin/python benchmarks/recording_breakdown.py                 # thread CPU ns per call
    .venv/bin/python benchmarks/recording_breakdown.py --callgrind     # + instructions per call

The recording wrapper of ``all_reduce`` around a no-op with its signature, built up one part at a
time; each row adds one part to the row above, so a row's difference to the row above is what that
part costs. Two designs:

- ``e0c72fd``: the design before issue 29 (``instrument()``'s generated wrapper, then the
  recorder's ``open_fast``/``close_ok`` making a ``FlightRecord`` object per call in a deque),
  re-typed below from ``ncclguard/recording/{instrument,flight,sites}.py`` at commit e0c72fd
  with each part switchable (a diagnosis, not an API: parts off are replaced by constants).
- ``new``: the wrapper ``instrument()`` builds now, cut after each of its parts
  (``ncclguard.recording.instrument.PARTS``), when this checkout has them.

Two measures of each row:

- thread CPU ns per call in a warm loop (``any(map(row, repeat(t, N)))``), rows interleaved in a
  shuffled order in every repeat, minus the bare no-op of the same repeat; median over repeats,
  with the spread of the part's per-repeat difference. The 1-minute load average is printed.
- ``--callgrind``: instructions per call (valgrind's callgrind, collecting only inside
  ``any()``: one dump per row), exact and the same under any load. The conversion to time is
  the ratio of the two measures over the whole wrapper (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import repeat
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._naming import _DTYPE_NAMES, REDUCE_OP_NAMES, dtype_name
from ncclguard.recording import phase as _phase

# ----------------------------------------------------------------------------- e0c72fd, re-typed
MAIN_PARTS = ("wrapper", "describe", "opname", "group", "recorder", "seq", "site", "time", "phase", "record", "ring")
MAIN_PART_NAMES = {
    "wrapper": "the generated wrapper (a frame with the op's parameters, the call through)",
    "describe": "describing the tensor (numel, dtype name)",
    "opname": "the op's name (ReduceOp hashed into a dict), async flag",
    "group": "the group's name (_World.default_pg, _World.pg_names)",
    "recorder": "open_fast/close_ok calls, nesting check, per-thread open stack",
    "seq": "sequence number (per-group dict, and the completed one)",
    "site": "call site (sys._getframe, the walk to the user's frame)",
    "time": "time (time.time() at open and at close)",
    "phase": "phase (the thread's phase path)",
    "record": "the record object (object.__new__, 20 slot writes, close's state)",
    "ring": "the ring (deque append)",
}

_MAIN_WRAPPER = """
def recorded(tensor, op=_default1, group=None, async_op=False):
    _data = tensor  # @describe
    if type(_data) is tensor_type:  # @describe
        _numel = _data.numel()  # @describe
        _dtype = dtype_names.get(_data.dtype) or dtype_name(_data.dtype)  # @describe
    else:  # @describe
        _numel, _dtype = describe(_data)  # @describe
    _numel, _dtype = 1, "float32"  # !describe
    _reduce_op = op  # @opname
    if _reduce_op is None:  # @opname
        _op = default_op  # @opname
    else:  # @opname
        try:  # @opname
            _op = op_names.get(_reduce_op, bare)  # @opname
        except TypeError:  # @opname
            _op = bare  # @opname
    _is_async = bool(async_op)  # @opname
    _op, _is_async = "all_reduce(SUM)", False  # !opname
    _pg = group if group is not None else world.default_pg  # @group
    _gname = world.pg_names.get(_pg, "?") if _pg is not None else "?"  # @group
    _gname = "0"  # !group
    _rec = open_fast(_op, _gname, _numel, _dtype, _is_async, None)  # @recorder
    if _rec is None:  # @recorder
        return original(tensor, op, group, async_op)  # @recorder
    try:  # @recorder
        _out = original(tensor, op, group, async_op)  # @recorder
    except BaseException as _exc:  # @recorder
        finish(_rec, _exc)  # @recorder
        raise  # @recorder
    if _is_async and _out is not None:  # @recorder
        attach(_rec, _out)  # @recorder
    else:  # @recorder
        close_ok(_rec)  # @recorder
    return _out  # @recorder
    return original(tensor, op, group, async_op)  # !recorder
"""

_MAIN_RECORDER = """
class Recorder:
    def __init__(self):
        self._records = deque(maxlen=2000)
        self._seq = {}
        self._done = {}
        self._open = {}

    def open_fast(self, op, group, numel, dtype, async_op=False, peer=None):
        tid = _get_ident()
        opened = self._open.get(tid)
        if opened:
            return None
        key = group if peer is None else group + ":p2p"  # @seq
        seq = self._seq.get(key, 0) + 1  # @seq
        self._seq[key] = seq  # @seq
        seq = 1  # !seq
        frame = _user_frame(_getframe(2))  # @site
        frame = None  # !site
        start = _time()  # @time
        start = 0.0  # !time
        phase = _MAIN.path if tid == _MAIN.ident else current_phase()  # @phase
        phase = ""  # !phase
        rec = _new_record(Record)  # @record
        rec.seq = seq  # @record
        rec.op = op  # @record
        rec.group = group  # @record
        rec.numel = numel  # @record
        rec.dtype = dtype  # @record
        rec.start = start  # @record
        rec.state = "started"  # @record
        rec.end = None  # @record
        rec.phase = phase  # @record
        rec.error = None  # @record
        rec.async_op = async_op  # @record
        rec.peer = peer  # @record
        rec.thread = tid  # @record
        rec.work = None  # @record
        rec.chunks_done = rec.chunks = rec.bytes_done = 0  # @record
        if frame is None:  # @record
            rec._site, rec._code, rec._lasti = "?", None, -1  # @record
        else:  # @record
            rec._site, rec._code, rec._lasti = None, frame.f_code, frame.f_lasti  # @record
        rec = _DUMMY  # !record
        self._records.append(rec)  # @ring
        if opened is None:
            self._open[tid] = [rec]
        else:
            opened.append(rec)
        return rec

    def close_ok(self, rec):
        if rec is None:
            return
        stack = self._open.get(rec.thread)
        if stack and stack[-1] is rec and rec.state == "started":
            stack.pop()
            rec.end = _time()  # @time
            rec.state = "completed"  # @record
            key = rec.group if rec.peer is None else rec.group + ":p2p"  # @seq
            if rec.seq > self._done.get(key, 0):  # @seq
                self._done[key] = rec.seq  # @seq
            return
        raise AssertionError("the breakdown's records close in order")

    def finish(self, rec, error=None):
        raise AssertionError("the breakdown's calls do not fail")

    attach = finish
"""


class _Record:
    """e0c72fd's FlightRecord, its slots only (the breakdown writes them as open_fast did)."""

    __slots__ = (
        *("seq", "op", "group", "numel", "dtype", "start", "state", "end", "phase", "_site", "_code", "_lasti"),
        *("error", "async_op", "peer", "thread", "work", "chunks_done", "chunks", "bytes_done"),
    )


def _main_user_frame() -> Callable[[Any], Any]:
    """e0c72fd's ``sites.user_frame`` (the walk to the first frame outside the frameworks)."""
    from ncclguard.recording import sites

    skip_prefixes, known, app_dirs = sites._skip_prefixes, sites._is_framework, sites._APP_DIRS

    def user_frame(frame: Any) -> Any:
        cache = sites._skip_prefixes_cache[0]
        prefixes = cache[1] if cache[0] == len(sys.modules) else skip_prefixes()
        while frame is not None:
            path = frame.f_code.co_filename
            skip = known.get(path)
            if skip is None:
                skip = known[path] = (path.startswith(prefixes) and not path.startswith(app_dirs)) or path.startswith(
                    "<"
                )
            if not skip:
                return frame
            frame = frame.f_back
        return None

    return user_frame


def _cut(source: str, parts: tuple[str, ...]) -> str:
    """The lines of ``source`` for ``parts`` on: ``# @p`` lines when p is on, ``# !p`` when off."""
    out = []
    for raw in source.splitlines():
        code, _, mark = raw.partition("  # ")
        if mark.startswith("@") and mark[1:] not in parts:
            continue
        if mark.startswith("!") and mark[1:] in parts:
            continue
        out.append(code if mark[:1] in ("@", "!") else raw)
    return "\n".join(out) + "\n"


def _noop(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> None:
    return None


def main_rows(original: Callable[..., Any] = _noop) -> dict[str, Callable[[Any], Any]]:
    """e0c72fd's wrapper around ``original``, one row per part added (``"+ part"``)."""
    rows: dict[str, Callable[[Any], Any]] = {}
    for k in range(len(MAIN_PARTS)):
        parts = MAIN_PARTS[: k + 1]
        ns: dict[str, Any] = {
            "deque": deque,
            "Record": _Record,
            "_get_ident": threading.get_ident,
            "_time": time.time,
            "_getframe": sys._getframe,
            "_user_frame": _main_user_frame(),
            "_MAIN": _phase.MAIN,
            "current_phase": _phase.current_phase,
            "_new_record": object.__new__,
        }
        dummy = object.__new__(_Record)
        dummy.thread, dummy.state, dummy.group, dummy.peer, dummy.seq = threading.get_ident(), "started", "0", None, 1
        ns["_DUMMY"] = dummy
        exec(compile(_cut(_MAIN_RECORDER, parts), "<e0c72fd recorder>", "exec"), ns)
        rec = ns["Recorder"]()
        op_names = {red: f"all_reduce({text})" for red, text in REDUCE_OP_NAMES.items()}
        wns: dict[str, Any] = {
            "original": original,
            "_default1": dist.ReduceOp.SUM,
            "op_names": op_names,
            "default_op": op_names[dist.ReduceOp.SUM],
            "bare": "all_reduce",
            "describe": None,
            "open_fast": rec.open_fast,
            "close_ok": rec.close_ok,
            "finish": rec.finish,
            "attach": rec.attach,
            "tensor_type": torch.Tensor,
            "world": compat.world(),
            "dtype_names": _DTYPE_NAMES,
            "dtype_name": dtype_name,
        }
        # The wrapper's file is ncclguard's (as instrument()'s "<ncclguard...>" is skipped): the walk
        # goes from it to the caller, as it does from a real wrapper.
        exec(compile(_cut(_MAIN_WRAPPER, parts), "<ncclguard.instrument:all_reduce>", "exec"), wns)
        rows["+ " + parts[-1]] = wns["recorded"]
    return rows


def new_rows(original: Callable[..., Any] = _noop) -> dict[str, Callable[[Any], Any]]:
    """This checkout's wrapper cut after each of its parts (empty where it has no PARTS)."""
    from ncclguard.recording import instrument as ins

    parts = getattr(ins, "PARTS", None)
    if parts is None:
        return {}
    spec = ins._spec("all_reduce", dist.all_reduce)
    rows = {"+ wrapper": ins._wrap(spec, original, like=dist.all_reduce, parts=(), compiled=False)}
    rows |= {
        "+ " + p: ins._wrap(spec, original, like=dist.all_reduce, parts=parts[: k + 1], compiled=False)
        for k, p in enumerate(parts)
    }
    return rows


def compiled_row(original: Callable[..., Any] = _noop) -> dict[str, Callable[[Any], Any]]:
    """The same body compiled (``_hotpath``, what instrument() installs where it was built)."""
    from ncclguard.recording import instrument as ins

    if getattr(ins, "_hotpath", None) is None:
        return {}
    spec = ins._spec("all_reduce", dist.all_reduce)
    return {"compiled whole": ins._wrap(spec, original, like=dist.all_reduce, compiled=True)}


def _deep(depth: int, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` called through ``depth`` frames whose code claims a torch file (as under DeepSpeed)."""
    ns: dict[str, Any] = {"leaf": fn}
    src = "def f0(x):\n    return leaf(x)\n" + "".join(
        f"def f{i}(x):\n    return f{i - 1}(x)\n" for i in range(1, depth)
    )
    exec(compile(src, dist.distributed_c10d.__file__, "exec"), ns)
    return ns[f"f{depth - 1}"]


def all_rows(deep: int) -> dict[str, Callable[[Any], Any]]:
    """Every row measured: the bare no-op, each design's rows, and the whole of each design called
    from ``deep`` framework frames (against the no-op called the same way)."""
    rows: dict[str, Callable[[Any], Any]] = {"bare no-op": _noop}
    main, new = main_rows(), new_rows()
    rows |= {f"e0c72fd {k}": v for k, v in main.items()}
    rows |= {f"new {k}": v for k, v in new.items()}
    rows[f"deep{deep} bare no-op"] = _deep(deep, _noop)
    rows[f"deep{deep} e0c72fd whole"] = _deep(deep, list(main.values())[-1])
    if new:
        rows[f"deep{deep} new whole"] = _deep(deep, new["+ close"])
    compiled = compiled_row()
    rows |= compiled
    if compiled:
        rows[f"deep{deep} compiled whole"] = _deep(deep, compiled["compiled whole"])
    return rows


def _warm(rows: dict[str, Callable[[Any], Any]], t: torch.Tensor) -> None:
    for fn in rows.values():
        for _ in range(2000):  # past the specialising interpreter's warm-up
            fn(t)


def cpu_ns(rows: dict[str, Callable[[Any], Any]], t: torch.Tensor, calls: int, repeats: int) -> dict[str, list[float]]:
    """Thread CPU ns per call of each row, one value per repeat (rows shuffled in each)."""
    got: dict[str, list[float]] = {k: [] for k in rows}
    order = list(rows)
    rnd = random.Random(0)
    for _ in range(repeats):
        rnd.shuffle(order)
        for k in order:
            fn = rows[k]
            begin = time.thread_time_ns()
            any(map(fn, repeat(t, calls)))
            got[k].append((time.thread_time_ns() - begin) / calls)
    return got


def gloo_pairs(pairs: int) -> dict[str, list[float]]:
    """Each design's rows around torch's real 1-element ``all_reduce`` on the gloo world of one:
    per row, µs of (row - plain) in pairs of single calls (which goes first alternates; rows in a
    shuffled order in each round), as benchmarks/recording_cost.py's verdict does for the whole."""
    real = dist.all_reduce.__dict__.get("__ncclguard_original__", dist.all_reduce)
    rows = {f"e0c72fd {k}": v for k, v in main_rows(real).items()}
    rows |= {f"new {k}": v for k, v in new_rows(real).items()}
    rows |= compiled_row(real)
    t = torch.ones(1)
    until = time.monotonic() + 2.0  # a fresh gloo group's first calls run in a slower regime
    while time.monotonic() < until:
        real(t)
    clock = time.perf_counter_ns
    diffs: dict[str, list[float]] = {k: [] for k in rows}
    order = list(rows)
    rnd = random.Random(1)
    for i in range(pairs):
        rnd.shuffle(order)
        for k in order:
            fn = rows[k]
            if i % 2:
                a = clock()
                fn(t)
                b = clock()
                real(t)
                c = clock()
                w, p = b - a, c - b
            else:
                a = clock()
                real(t)
                b = clock()
                fn(t)
                c = clock()
                p, w = b - a, c - b
            diffs[k].append((w - p) / 1e3)
    return diffs


def _child_callgrind(out: Path, calls: int, deep: int) -> None:
    """Under valgrind: turns instrumentation on, then runs each row once inside any() (callgrind
    collects there only and dumps after each), and writes the rows' order to ``out``."""
    t, rows = _setup(deep)
    _warm(rows, t)
    ctl = subprocess.Popen(["callgrind_control", "-i", "on", str(os.getpid())], stdout=subprocess.DEVNULL)
    while ctl.poll() is None:
        sum(range(100))
    for fn in rows.values():
        any(map(fn, repeat(t, calls)))
    out.write_text(json.dumps(list(rows)))


def callgrind(calls: int, deep: int) -> dict[str, float]:
    """Instructions per call of each row (see :func:`_child_callgrind`)."""
    with tempfile.TemporaryDirectory() as tmp:
        order = Path(tmp) / "order.json"
        prefix = Path(tmp) / "cg.out"
        cmd = [
            *("valgrind", "--tool=callgrind", "--instr-atstart=no", "--toggle-collect=builtin_any"),
            *("--dump-after=builtin_any", f"--callgrind-out-file={prefix}"),
            *(sys.executable, __file__, "--child-callgrind", str(order), "--calls", str(calls), "--deep", str(deep)),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
        names = json.loads(order.read_text())
        dumps = sorted(Path(tmp).glob("cg.out.*"), key=lambda p: int(p.suffix[1:]))
        totals = []
        for p in dumps:
            line = next(x for x in p.read_text().splitlines() if x.startswith(("summary:", "totals:")))
            totals.append(int(line.split()[1]))
        if len(totals) != len(names):
            raise SystemExit(f"callgrind: {len(totals)} dumps for {len(names)} rows")
        return {k: v / calls for k, v in zip(names, totals, strict=True)}


def _setup(deep: int) -> tuple[torch.Tensor, dict[str, Callable[[Any], Any]]]:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return torch.ones(1), all_rows(deep)


def _parts_table(prefix: str, cpu: dict[str, list[float]], ir: dict[str, float] | None) -> list[dict[str, Any]]:
    """Per part of one design: its CPU ns (median over repeats of the row minus the row above,
    with their min and max) and its instructions."""
    names = [k for k in cpu if k.startswith(prefix + " + ")]
    out, above = [], "bare no-op"
    for k in names:
        per = [a - b for a, b in zip(cpu[k], cpu[above], strict=True)]
        out.append(
            {
                "part": k.removeprefix(prefix + " + "),
                "cpu_ns": round(statistics.median(per)),
                "cpu_ns_min": round(min(per)),
                "cpu_ns_max": round(max(per)),
                "instructions": None if ir is None else round(ir[k] - ir[above]),
            }
        )
        above = k
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000, help="calls per row and repeat (default 20000)")
    ap.add_argument("--repeats", type=int, default=15, help="repeats of every row (default 15)")
    ap.add_argument("--deep", type=int, default=10, help="framework frames above the deep rows' wrapper (10)")
    ap.add_argument("--callgrind", action="store_true", help="also count instructions under valgrind")
    ap.add_argument("--gloo", type=int, default=0, help="also time every row around a real gloo call, N pairs")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child-callgrind", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_callgrind is not None:
        _child_callgrind(args.child_callgrind, args.calls, args.deep)
        return 0
    t, rows = _setup(args.deep)
    _warm(rows, t)
    load0 = os.getloadavg()[0]
    cpu = cpu_ns(rows, t, args.calls, args.repeats)
    load1 = os.getloadavg()[0]
    ir = callgrind(min(args.calls, 5000), args.deep) if args.callgrind else None
    doc: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "load_1min": [load0, load1]}
    for design in ("e0c72fd", "new"):
        table = _parts_table(design, cpu, ir)
        if not table:
            continue
        whole = f"{design} + {table[-1]['part']}"
        total_ns = statistics.median(a - b for a, b in zip(cpu[whole], cpu["bare no-op"], strict=True))
        total_ir = None if ir is None else ir[whole] - ir["bare no-op"]
        deep_ns = statistics.median(
            a - b
            for a, b in zip(cpu[f"deep{args.deep} {design} whole"], cpu[f"deep{args.deep} bare no-op"], strict=True)
        )
        deep_ir = None if ir is None else ir[f"deep{args.deep} {design} whole"] - ir[f"deep{args.deep} bare no-op"]
        print(f"\n{design}: recording one all_reduce around a no-op, part by part")
        print(f"{'part':70s} {'CPU ns':>7s} {'(min..max)':>13s} {'instr.':>7s}")
        for row in table:
            label = MAIN_PART_NAMES.get(row["part"], row["part"]) if design == "e0c72fd" else row["part"]
            spread = f"({row['cpu_ns_min']}..{row['cpu_ns_max']})"
            instr = "" if row["instructions"] is None else f"{row['instructions']:7d}"
            print(f"{label[:70]:70s} {row['cpu_ns']:7d} {spread:>13s} {instr}")
        print(
            f"{'whole, caller right above':70s} {total_ns:7.0f} {'':13s} {'' if total_ir is None else f'{total_ir:7.0f}'}"
        )
        print(
            f"{f'whole, caller {args.deep} framework frames up':70s} {deep_ns:7.0f} {'':13s} "
            f"{'' if deep_ir is None else f'{deep_ir:7.0f}'}"
        )
        if total_ir:
            print(f"({total_ir / total_ns:.1f} instructions per CPU ns over the whole wrapper)")
        doc[design] = {"parts": table, "whole_cpu_ns": total_ns, "whole_instructions": total_ir}
        doc[design] |= {"deep_cpu_ns": deep_ns, "deep_instructions": deep_ir, "deep_frames": args.deep}
    if "compiled whole" in cpu:
        d = args.deep
        c_ns = statistics.median(a - b for a, b in zip(cpu["compiled whole"], cpu["bare no-op"], strict=True))
        c_deep = statistics.median(
            a - b for a, b in zip(cpu[f"deep{d} compiled whole"], cpu[f"deep{d} bare no-op"], strict=True)
        )
        c_ir = None if ir is None else ir["compiled whole"] - ir["bare no-op"]
        c_deep_ir = None if ir is None else ir[f"deep{d} compiled whole"] - ir[f"deep{d} bare no-op"]
        print("\ncompiled (ncclguard/recording/_hotpath.c, the same body in C: what instrument() installs)")
        print(f"{'whole, caller right above':70s} {c_ns:7.0f} {'':13s} {'' if c_ir is None else f'{c_ir:7.0f}'}")
        print(
            f"{f'whole, caller {d} framework frames up':70s} {c_deep:7.0f} {'':13s} "
            f"{'' if c_deep_ir is None else f'{c_deep_ir:7.0f}'}"
        )
        doc["compiled"] = {"whole_cpu_ns": c_ns, "whole_instructions": c_ir, "deep_cpu_ns": c_deep}
        doc["compiled"]["deep_instructions"] = c_deep_ir
    if args.gloo:
        load2 = os.getloadavg()[0]
        pairs = gloo_pairs(args.gloo)
        load3 = os.getloadavg()[0]
        print(
            f"\naround a real 1-element gloo all_reduce (world of one): median of {args.gloo} pairs (row - plain), us"
        )
        doc["gloo"] = {"pairs": args.gloo, "load_1min": [load2, load3], "rows": {}}
        for design in ("e0c72fd", "new", "compiled"):
            names = [k for k in pairs if k.startswith(design + " ")]
            above = 0.0
            for k in names:
                med = statistics.median(pairs[k])
                print(f"  {k:40s} {med:6.2f}  (part {med - above:+.2f})")
                doc["gloo"]["rows"][k] = {"median_us": round(med, 3), "part_us": round(med - above, 3)}
                above = med
        print(f"  (1-min load {load2:.2f} -> {load3:.2f})")
    print(
        f"\n{os.cpu_count()} cores, 1-min load {load0:.2f} -> {load1:.2f}, {args.repeats} repeats x {args.calls} calls"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
