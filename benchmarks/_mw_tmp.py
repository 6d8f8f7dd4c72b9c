"""How much of the library a reader opens: lines, and the modules that run in four walks (issue 46).

Per commit (read with ``git cat-file``, nothing checked out), two measures:

1. ``lines``: the ``.py`` files of ``ncclguard/`` and ``integrations/``: lines in all, code lines
   (a line with a token other than a comment, outside docstrings), comment and docstring lines
   (docstrings found with ``ast``, comments with ``tokenize``), blank lines; modules; modules over
   500 lines (the house rule's count: ``len(text.splitlines())``).
2. ``walks``: the modules of ``ncclguard/`` and ``integrations/`` whose functions run during a
   scenario, after its set-up. The commit's ``ncclguard/``, ``integrations/`` and ``tests/workers/``
   are exported (``git archive``) to a temporary folder and each rank imports them from there
   (``ncclguard.integrations`` mapped to the exported ``integrations/``, as pyproject.toml's
   package-dir does; both checked). A profile hook (``sys.setprofile`` and ``threading.setprofile``,
   installed before any of the library's threads start) records the ``co_filename`` of every Python
   call into the library while a window is open; module bodies (``<module>`` code, import time) are
   not counted. Every launch is a process group with a hard timeout, killed whole past it.

   a. ``safe_all_reduce``: 2 gloo ranks under ``torchrun --standalone``; 3 calls to warm up, then
      the window is one ``ncclguard.safe_all_reduce`` call (all threads, on rank 0; rank 1 beside it).
   b. ``failed step, heal``: ``tests/workers/heal_worker.py`` of the commit, 3 ranks under the
      commit's own ``ncclguard.testing.launch.spawn`` with one restart (rank 1 SIGKILLs itself at
      a step of ``RecoveringStep(heal=True)``, is restarted and healed from rank 0). The window is
      the ``RecoveringStep.__call__`` of that step on rank 0 (the survivor that sends the state): the
      failure, the commit, the rebuild, the heal and the redone step's commit. Counted: the main
      thread, the store's call threads (``ncclguard-store-call``: the bounded store calls the step
      waits on) and the threads started in the window. Threads that were running before it and poll
      on their own clock (the left-behind fence, a watchdog) enter modules or not by timing: their
      modules are listed beside, not counted.
   c. ``incident to summary.txt``: 2 gloo ranks under ``torchrun --standalone``, a watchdog each
      (heartbeat 0.3 s, hang bound 1.5 s, action ``report``); rank 0 enters a plain
      ``dist.all_reduce`` that rank 1 does not (it sleeps). The window runs from the stall's start
      to the moment ``summary.txt`` is written (``Path.write_text``/``os.replace`` hooked, a poll
      behind them); counted are the watchdog thread (``ncclguard-watchdog``), the store's call
      threads that run its bounded store calls (``ncclguard-store-call``) and the threads started in
      the window, on both ranks together. Ticks before the hang bound run only the sensors, which
      the detecting tick runs too. A window of steady ticks before the stall is shown beside, so
      that the modules the incident adds can be read off.
   d. ``adding a sensor``: no trace; the files docs/architecture.md's "Where to add things" names
      for a sensor at that commit (or that it names none, and what it names for a detector).

Usage:
    python benchmarks/module_walks.py --commit before=9e53ee7 --commit after=HEAD \
        --out benchmarks/results/module_walks.json [--scenarios a,b,c] [--lines-only]

About 2-4 minutes on 2 cores (the heal launch is most of it).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()
FOLDERS = ("ncclguard", "integrations")
LONG = 500  # the house rule: no module over 500 lines
HEARTBEAT_S, HANG_S = 0.3, 1.5  # scenario c's watchdog
TIMEOUT_A_S, TIMEOUT_B_S, TIMEOUT_C_S = 120, 300, 150


# ---------------------------------------------------------------------------------------------
# git


def git(*args: str, input_bytes: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", *args], cwd=REPO, input=input_bytes, capture_output=True, check=True, timeout=120
    ).stdout


def resolve(rev: str) -> str:
    return git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()


def tracked(commit: str, folders: Iterable[str]) -> list[str]:
    out = git("ls-tree", "-r", "--name-only", commit, "--", *folders).decode()
    return sorted(p for p in out.splitlines() if p.endswith(".py"))


def read_blobs(commit: str, paths: Sequence[str]) -> dict[str, str]:
    """The text of ``paths`` at ``commit``, in one ``git cat-file --batch``."""
    raw = git("cat-file", "--batch", input_bytes="".join(f"{commit}:{p}\n" for p in paths).encode())
    texts, pos = {}, 0
    for p in paths:
        end = raw.index(b"\n", pos)
        header = raw[pos:end].split()
        if len(header) < 3 or header[1] != b"blob":
            raise RuntimeError(f"{commit}:{p}: {raw[pos:end]!r}")
        size = int(header[2])
        texts[p] = raw[end + 1 : end + 1 + size].decode("utf-8")
        pos = end + 1 + size + 1
    return texts


# ---------------------------------------------------------------------------------------------
# 1. lines


def docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    end = body[0].end_lineno or body[0].lineno
                    lines.update(range(body[0].lineno, end + 1))
    return lines


def count_lines(text: str) -> dict[str, int]:
    """``total``, ``code``, ``comment`` (comments and docstrings), ``docstring`` (of ``comment``),
    ``blank``. A line with code and a comment is code; a blank line inside a docstring is docstring."""
    lines = text.splitlines()
    docs = docstring_lines(ast.parse(text))
    code: set[int] = set()
    comment: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    skip |= {tokenize.ENCODING, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comment.add(tok.start[0])
        elif tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    counts = {"total": len(lines), "code": 0, "comment": 0, "docstring": 0, "blank": 0}
    for n, line in enumerate(lines, 1):
        if n in docs:
            counts["comment"] += 1
            counts["docstring"] += 1
        elif n in code:
            counts["code"] += 1
        elif n in comment:
            counts["comment"] += 1
        elif not line.strip():
            counts["blank"] += 1
        else:  # a line of a string token that the tokenizer did not mark (not seen so far)
            counts["code"] += 1
    return counts


def lines_at(commit: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for folder in FOLDERS:
        paths = tracked(commit, [folder])
        texts = read_blobs(commit, paths)
        per = {p: count_lines(t) for p, t in texts.items()}
        sums = {k: sum(c[k] for c in per.values()) for k in ("total", "code", "comment", "docstring", "blank")}
        long = {p: c["total"] for p, c in sorted(per.items(), key=lambda kv: -kv[1]["total"]) if c["total"] > LONG}
        out[folder] = {**sums, "modules": len(per), "over_500": long}
    return out


# ---------------------------------------------------------------------------------------------
# 4 (d). where to add a sensor


def where_to_add(commit: str) -> dict[str, Any]:
    try:
        doc = read_blobs(commit, ["docs/architecture.md"])["docs/architecture.md"]
    except (RuntimeError, subprocess.CalledProcessError):
        return {"architecture_md": False, "section": False, "sensor": None, "detector": None}
    m = re.search(r"^## Where to add things\s*$(.*?)(?=^## |\Z)", doc, re.M | re.S)
    if m is None:
        return {"architecture_md": True, "section": False, "sensor": None, "detector": None}
    bullets = re.split(r"^- ", m.group(1), flags=re.M)[1:]

    def entry(word: str) -> dict[str, Any] | None:
        for b in bullets:
            title = re.match(r"\*\*(.+?)\*\*", b)
            if title and re.search(word, title.group(1), re.I):
                text = " ".join(b.split())
                names = re.findall(r"`([^`]+)`", b)
                files = [n for n in names if n.endswith((".py", "/")) or "/" in n and " " not in n]
                return {"title": title.group(1), "files": list(dict.fromkeys(files)), "text": text}
        return None

    return {"architecture_md": True, "section": True, "sensor": entry(r"\bsensor"), "detector": entry(r"\bdetector")}


# ---------------------------------------------------------------------------------------------
# rank side: the package of an exported commit, the profile hook, the scenarios


def map_package(root: Path) -> None:
    """``ncclguard`` from ``root/ncclguard`` and ``ncclguard.integrations`` from ``root/integrations``
    (the editable install maps both to this checkout; a finder ahead of it maps them here)."""
    import importlib.abc
    import importlib.machinery

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            where = {"ncclguard": root, "ncclguard.integrations": root / "integrations"}.get(fullname)
            if where is None:
                return None
            if fullname == "ncclguard":
                return importlib.machinery.PathFinder.find_spec(fullname, [str(root)])
            init = where / "__init__.py"
            loader = importlib.machinery.SourceFileLoader(fullname, str(init))
            return importlib.util.spec_from_file_location(
                fullname, init, loader=loader, submodule_search_locations=[str(where)]
            )

    import importlib.util

    sys.path[:0] = [str(root), str(root / "tests" / "workers")]
    sys.meta_path.insert(0, Finder())


def where_loaded(root: Path) -> dict[str, Any]:
    import importlib.util

    import ncclguard

    spec = importlib.util.find_spec("ncclguard.integrations")
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    ok = Path(ncclguard.__file__).resolve().is_relative_to(root.resolve())
    ok = ok and bool(locs) and all(Path(p).resolve() == (root / "integrations").resolve() for p in locs)
    return {"ncclguard": ncclguard.__file__, "integrations": locs, "from_export": ok}


class Tracer:
    """Records, while a window is open, the first call into each library module per thread."""

    def __init__(self, root: Path) -> None:
        self.prefixes = [(str(root.resolve() / f) + os.sep, f) for f in FOLDERS]
        self.foreign = [str(REPO / f) + os.sep for f in FOLDERS]  # the checkout's copy: must not load
        self.active = False
        self.cache: dict[str, str | None] = {}
        self.seen: dict[tuple[int, str], tuple[float, str]] = {}
        self.names: dict[int, str] = {}
        self.leaks: set[str] = set()
        self.marks: dict[str, float] = {}
        self.started: dict[int, float] = {}  # threads started while a window was open
        self.fns: dict[str, set] = {}

    def module(self, filename: str) -> str | None:
        for prefix, folder in self.prefixes:
            if filename.startswith(prefix):
                return f"{folder}/{filename[len(prefix) :]}"
        if any(filename.startswith(p) for p in self.foreign):
            self.leaks.add(filename)
        return None

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.active:
            return
        code = frame.f_code
        fn = code.co_filename
        try:
            mod = self.cache[fn]
        except KeyError:
            mod = self.cache[fn] = self.module(fn)
        if mod is None or code.co_name == "<module>":
            return
        key = (threading.get_ident(), mod)
        self.fns.setdefault(mod, set()).add(code.co_name)
        if key not in self.seen:
            self.seen[key] = (time.monotonic(), code.co_name)
            if key[0] not in self.names:
                self.names[key[0]] = threading.current_thread().name

    def install(self) -> None:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        start = threading.Thread.start

        def counted_start(thread: threading.Thread) -> None:
            start(thread)
            if self.active and thread.ident is not None:
                self.started[thread.ident] = time.monotonic()

        threading.Thread.start = counted_start  # type: ignore[method-assign]

    def open(self) -> float:
        self.seen.clear()
        self.fns.clear()
        self.started.clear()
        t = time.monotonic()
        self.active = True
        return t

    def close(self) -> dict[str, Any]:
        self.active = False
        t = time.monotonic()
        rows = [
            {"thread": self.names.get(ident, str(ident)), "new_thread": ident in self.started,
             "module": mod, "t": at, "first": fn}
            for (ident, mod), (at, fn) in sorted(self.seen.items(), key=lambda kv: kv[1][0])
        ]  # fmt: skip
        return {"closed": t, "calls": rows, "leaks": sorted(self.leaks), "fns": {k: sorted(v) for k, v in self.fns.items()}}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.monotonic())


def hook_summary_writes(tracer: Tracer) -> None:
    """Marks ``summary`` when a file named summary.txt is written or renamed into place."""
    import pathlib

    write_text, replace, rename = pathlib.Path.write_text, os.replace, os.rename

    def hooked_write_text(self: pathlib.Path, *a: Any, **kw: Any) -> int:
        n = write_text(self, *a, **kw)
        if self.name == "summary.txt":
            tracer.mark("summary")
        return n

    def hooked(fn: Any) -> Any:
        def move(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
            fn(src, dst, *a, **kw)
            if os.path.basename(os.fspath(dst)) == "summary.txt":
                tracer.mark("summary")

        return move

    pathlib.Path.write_text = hooked_write_text  # type: ignore[method-assign]
    os.replace, os.rename = hooked(replace), hooked(rename)


def dump(out: Path, name: str, data: Any) -> None:
    tmp = out / f".{name}"
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(out / name)


def scenario_a(tracer: Tracer, out: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import safe_all_reduce

    t = torch.ones(4)
    for _ in range(3):
        assert safe_all_reduce(t, timeout=30)
    dist.barrier()
    t0 = tracer.open()
    res = safe_all_reduce(t, timeout=30)
    rec = tracer.close()
    dist.barrier()
    dump(out, f"a-rank{rank}.json", {"opened": t0, **rec, "ok": bool(res)})


def scenario_c(tracer: Tracer, out: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import start_watchdog

    incidents = out / "incidents"
    start_watchdog(heartbeat_s=HEARTBEAT_S, hang_timeout_s=HANG_S, incident_dir=incidents, action="report")
    dist.barrier()
    time.sleep(4 * HEARTBEAT_S)  # each rank has seen its peer's heartbeats
    t0 = tracer.open()
    time.sleep(HANG_S)  # steady ticks, for the modules every tick walks
    steady = tracer.close()
    dump(out, f"c-steady-rank{rank}.json", {"opened": t0, **steady})
    dist.barrier()
    t0 = tracer.open()
    if rank == 0:
        dist.all_reduce(torch.ones(2))  # MARK: stalled (rank 1 is not in it until the report is out)
    else:
        end = time.monotonic() + 60
        while time.monotonic() < end and not list(incidents.glob("*/summary.txt")):
            time.sleep(0.01)
        tracer.mark("summary_seen")
        dist.all_reduce(torch.ones(2))
    rec = tracer.close()
    dump(out, f"c-rank{rank}.json", {"opened": t0, **rec, "marks": tracer.marks})


def scenario_b(tracer: Tracer, out: Path, root: Path) -> None:
    """heal_worker.py of the commit, each RecoveringStep call in a window of its own."""
    import runpy

    import ncclguard

    cls = ncclguard.RecoveringStep
    call = cls.__call__
    rank, life = int(os.environ["RANK"]), int(os.environ.get("NCCLGUARD_RESTART_COUNT", "0") or 0)
    n = [0]

    def traced(self: Any, *a: Any, **kw: Any) -> Any:
        t0 = tracer.open()
        res = None
        try:
            res = call(self, *a, **kw)
            return res
        finally:
            rec = tracer.close()
            n[0] += 1
            info = {"step": kw.get("step"), "ok": getattr(res, "ok", None), "attempts": getattr(res, "attempts", None)}
            info["healed"] = getattr(getattr(res, "healed", None), "role", None)
            dump(out, f"b-rank{rank}-life{life}-call{n[0]:03d}.json", {"opened": t0, **rec, **info})

    cls.__call__ = traced
    worker = root / "tests" / "workers" / "heal_worker.py"
    sys.argv = [str(worker)]
    runpy.run_path(str(worker), run_name="__main__")


def rank_main(args: argparse.Namespace) -> None:
    root, out = Path(args.root), Path(args.out)
    map_package(root)
    from datetime import timedelta

    import torch  # noqa: F401  (imported before the hook: import time is not counted)
    import torch.distributed as dist

    import ncclguard  # noqa: F401

    loaded = where_loaded(root)
    rank = int(os.environ["RANK"])
    dump(out, f"loaded-{args.scenario}-rank{rank}.json", loaded)
    if not loaded["from_export"]:
        raise SystemExit(f"the library did not load from {root}: {loaded}")
    tracer = Tracer(root)
    if args.scenario == "b":
        tracer.install()
        scenario_b(tracer, out, root)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    tracer.install()
    hook_summary_writes(tracer)
    {"a": scenario_a, "c": scenario_c}[args.scenario](tracer, out, rank)
    sys.stdout.flush()
    os._exit(0)  # a watchdog's threads and gloo's queue: no interpreter shutdown to wait on


def spawn_main(args: argparse.Namespace) -> None:
    """Runs scenario b's 3 ranks under the commit's own launcher (restarts the killed rank)."""
    root, out = Path(args.root), Path(args.out)
    map_package(root)
    from ncclguard.testing.launch import spawn

    argv = [sys.executable, str(SELF), "rank", "--root", str(root), "--out", str(out), "--scenario", "b"]
    res = spawn(argv, 3, timeout_s=args.timeout, env=os.environ, cwd=str(root), restarts=1, restart_on=[-9])
    (out / "launch.log").write_text(res.output())
    dump(out, "spawn.json", {"timed_out": res.timed_out, "returncodes": {r.rank: r.returncode for r in res.ranks}})


# ---------------------------------------------------------------------------------------------
# driver


def run_bounded(cmd: Sequence[str], env: dict[str, str], cwd: Path, timeout_s: float, log: Path) -> int:
    """Runs ``cmd`` in a session of its own; past ``timeout_s`` the whole group is killed, and after
    it, in any case, every process that carries this launch's mark in its environment (torchrun and
    the launcher start each rank in a session of its own; a rank may outlive its launcher)."""
    mark = f"{os.getpid()}-{time.time_ns()}"
    env = {**env, "MODULE_WALKS_LAUNCH": mark}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            f.write(f"\nmodule_walks: killed after {timeout_s} s\n")
            return -9
        finally:
            kill_marked(proc, mark)


def kill_marked(proc: subprocess.Popen, mark: str) -> None:
    import psutil

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for p in psutil.process_iter():
        try:
            if p.environ().get("MODULE_WALKS_LAUNCH") == mark:
                p.kill()
        except (psutil.Error, OSError):
            pass


def export(commit: str, dest: Path) -> dict[str, Any]:
    want = ["ncclguard", "integrations", "tests/workers"]
    have = [p for p in want if git("ls-tree", "--name-only", commit, "--", p).strip()]
    tar = git("archive", "--format=tar", commit, "--", *have)
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True, timeout=120)
    # The recorder's compiled part is a build output (not in git): the checkout's, where its source
    # is the commit's; otherwise the commit runs its Python wrapper (which records the same).
    note = "no compiled _hotpath in the checkout"
    src = "ncclguard/recording/_hotpath.c"
    built = sorted((REPO / "ncclguard" / "recording").glob("_hotpath*.so"))
    if built and (dest / src).exists():
        if (dest / src).read_bytes() == (REPO / src).read_bytes():
            for so in built:
                shutil.copy2(so, dest / "ncclguard" / "recording" / so.name)
            note = "the checkout's compiled _hotpath (same source)"
        else:
            note = "the commit's _hotpath.c differs from the checkout's: its Python wrapper runs"
    return {"exported": have, "hotpath": note}


def clean_env(root: Path, out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLGUARD_", "TORCHELASTIC_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(k, None)
    env.update({"NCCLGUARD_TEST_OUT": str(out), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests" / "workers")])
    return env


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def by_folder(modules: Iterable[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for m in sorted(set(modules)):
        groups.setdefault(m.rsplit("/", 1)[0], []).append(m.rsplit("/", 1)[1])
    return groups


def walk(modules: Iterable[str], **extra: Any) -> dict[str, Any]:
    mods = sorted(set(modules))
    return {"count": len(mods), "folders": len(by_folder(mods)), "modules": mods, "by_folder": by_folder(mods), **extra}


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def torchrun(scenario: str, root: Path, out: Path, timeout_s: float) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["--monitor-interval=0.1", str(SELF), "rank", "--root", str(root), "--out", str(out)]
    return run_bounded([*cmd, "--scenario", scenario], clean_env(root, out), root, timeout_s, out / "launch.log")


def walk_a(root: Path, out: Path) -> dict[str, Any]:
    rc = torchrun("a", root, out, TIMEOUT_A_S)
    r0, r1 = load(out / "a-rank0.json"), load(out / "a-rank1.json")
    if rc != 0 or not r0:
        return {"error": f"exit {rc}", "log": tail(out / "launch.log")}
    threads = sorted({c["thread"] for c in r0["calls"]})
    return walk(
        [c["module"] for c in r0["calls"]],
        rank=0,
        threads=threads,
        ok=r0["ok"],
        rank1=sorted({c["module"] for c in r1.get("calls", [])}),
        leaks=r0["leaks"],
    )


def walk_b(root: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(SELF), "spawn", "--root", str(root), "--out", str(out), "--timeout", str(TIMEOUT_B_S)]
    rc = run_bounded(cmd, clean_env(root, out), root, TIMEOUT_B_S + 30, out / "driver.log")
    spawned = load(out / "spawn.json")
    calls = {p.name: load(p) for p in sorted(out.glob("b-rank*-call*.json"))}
    failed = {n: c for n, c in calls.items() if (c.get("attempts") or 1) > 1 or c.get("ok") is False}
    source = [n for n in failed if n.startswith("b-rank0-life0")]
    if not source:
        return {
            "error": f"no failed step on rank 0 (exit {rc}, launch {spawned})",
            "log": tail(out / "driver.log") + tail(out / "launch.log"),
        }
    rec = failed[source[0]]
    # The call before it on the same rank: a clean step of the same run (what any step walks).
    names = list(calls)
    before = calls[names[names.index(source[0]) - 1]] if names.index(source[0]) > 0 else {"calls": []}

    def counted(c: dict[str, Any]) -> bool:
        return c["thread"] in ("MainThread", "ncclguard-store-call") or c["new_thread"]

    clean = sorted({c["module"] for c in before["calls"] if counted(c)})

    mods = [c["module"] for c in rec["calls"] if counted(c)]
    others = sorted({c["module"] for c in rec["calls"] if not counted(c)} - set(mods))
    threads = sorted({c["thread"] for c in rec["calls"]})
    main_only = sorted({c["module"] for c in rec["calls"] if c["thread"] == "MainThread"})
    by_rank = {n.split("-call")[0]: sorted({c["module"] for c in v["calls"] if counted(c)}) for n, v in failed.items()}
    return walk(
        mods,
        rank=0,
        step=rec["step"],
        attempts=rec["attempts"],
        healed_role=rec["healed"],
        window_s=round(rec["closed"] - rec["opened"], 3),
        threads=threads,
        main_thread_only=len(main_only),
        background_threads_only=others,
        clean_step=clean,
        added_by_failure=sorted(set(mods) - set(clean)),
        failed_calls_by_rank=by_rank,
        launch=spawned,
        leaks=rec["leaks"],
    )


def walk_c(root: Path, out: Path) -> dict[str, Any]:
    rc = torchrun("c", root, out, TIMEOUT_C_S)
    ranks = [load(out / f"c-rank{r}.json") for r in (0, 1)]
    steady = [load(out / f"c-steady-rank{r}.json") for r in (0, 1)]
    if not all(ranks):
        return {"error": f"exit {rc}", "log": tail(out / "launch.log")}
    written = [r["marks"]["summary"] for r in ranks if "summary" in r["marks"]]
    seen = [r["marks"]["summary_seen"] for r in ranks if "summary_seen" in r["marks"]]
    if not written and not seen:
        return {"error": "no summary.txt", "log": tail(out / "launch.log")}
    end = min(written) if written else min(seen)

    def counted(c: dict[str, Any]) -> bool:
        return c["thread"] in ("ncclguard-watchdog", "ncclguard-store-call") or c["new_thread"]

    per_rank = [sorted({c["module"] for c in r["calls"] if counted(c) and c["t"] <= end}) for r in ranks]
    ticks = sorted({c["module"] for s in steady for c in s.get("calls", []) if c["thread"] == "ncclguard-watchdog"})
    mods = set(per_rank[0]) | set(per_rank[1])
    threads = sorted({c["thread"] for r in ranks for c in r["calls"] if counted(c) and c["t"] <= end})
    return walk(
        mods,
        ranks=[0, 1],
        window_s=round(end - min(r["opened"] for r in ranks), 3),
        summary_by="write hook" if written else "poll",
        threads=threads,
        per_rank=per_rank,
        steady_tick=ticks,
        added_by_incident=sorted(mods - set(ticks)),
        leaks=sorted({x for r in ranks for x in r["leaks"]}),
    )


def walks_at(commit: str, scenarios: Sequence[str], work: Path) -> dict[str, Any]:
    root = work / f"tree-{commit[:10]}"
    info = export(commit, root)
    res: dict[str, Any] = {"export": info}
    for s, fn in (("a", walk_a), ("b", walk_b), ("c", walk_c)):
        if s not in scenarios:
            continue
        out = work / f"{commit[:10]}-{s}"
        out.mkdir()
        t0 = time.monotonic()
        try:
            res[s] = fn(root, out)
        except (OSError, ValueError, KeyError, RuntimeError, subprocess.SubprocessError) as exc:
            # one scenario's failure is reported, the others still run
            res[s] = {"error": repr(exc)}
        if res[s].get("leaks"):
            res[s]["error"] = f"modules loaded from the checkout, not the export: {res[s]['leaks']}"
        res[s]["wall_s"] = round(time.monotonic() - t0, 1)
        loaded = sorted(out.glob("loaded-*.json"))
        res[s]["loaded_from"] = load(loaded[0]) if loaded else None
        print(f"  {commit[:10]} {s}: {res[s].get('count', res[s].get('error'))} ({res[s]['wall_s']} s)", flush=True)
    return res


# ---------------------------------------------------------------------------------------------
# report


TITLES = {
    "a": "(a) one safe_all_reduce call",
    "b": "(b) failed step through the engine, heal",
    "c": "(c) incident, detection to summary.txt",
    "d": "(d) adding a sensor: files named",
}


def d_count(d: dict[str, Any]) -> str:
    if d.get("sensor"):
        return str(len(d["sensor"]["files"]))
    det = d.get("detector")
    return "no entry" + (f" (detector: {len(det['files'])})" if det else "")


def print_report(results: dict[str, Any]) -> None:
    labels = list(results["commits"])
    head = f"{'':44}" + "".join(f"{lab + ' ' + results['commits'][lab]['commit'][:8]:>34}" for lab in labels)
    print("\nLines (all / code / comments+docstrings / blank; modules; over 500)")
    print(head)
    for folder in FOLDERS:
        cells = []
        for lab in labels:
            c = results["commits"][lab]["lines"][folder]
            cells.append(f"{c['total']}/{c['code']}/{c['comment']}/{c['blank']}; {c['modules']}; {len(c['over_500'])}")
        print(f"{folder:44}" + "".join(f"{x:>34}" for x in cells))
    for lab in labels:
        for folder in FOLDERS:
            long = results["commits"][lab]["lines"][folder]["over_500"]
            if long:
                print(f"  {lab}, over 500: " + ", ".join(f"{p} {n}" for p, n in long.items()))
    print("\nModules walked")
    print(head)
    for s in ("a", "b", "c", "d"):
        cells = []
        for lab in labels:
            r = results["commits"][lab].get("walks", {}).get(s) if s != "d" else None
            if s == "d":
                cells.append(d_count(results["commits"][lab]["sensor"]))
            elif r is None:
                cells.append("-")
            else:
                cells.append("error" if "error" in r else f"{r['count']} in {r['folders']} folders")
        print(f"{TITLES[s]:44}" + "".join(f"{x:>34}" for x in cells))
    for lab in labels:
        res = results["commits"][lab]
        print(f"\n== {lab} ({res['commit'][:10]})")
        for s in ("a", "b", "c"):
            r = res.get("walks", {}).get(s)
            if not r:
                continue
            print(f"{TITLES[s]}: {r.get('count', r.get('error'))}")
            for folder, mods in r.get("by_folder", {}).items():
                print(f"    {folder}/: {', '.join(mods)}")
            for base, added in (("clean_step", "added_by_failure"), ("steady_tick", "added_by_incident")):
                if base in r:
                    print(f"    ({len(r[base])} in a {base.replace('_', ' ')}; {added.replace('_', ' ')}: ", end="")
                    print(f"{', '.join(m.split('/', 1)[1] for m in r[added])})")
            if r.get("background_threads_only"):
                print(f"    (not counted, background threads only: {', '.join(r['background_threads_only'])})")
        d = res["sensor"]
        entry = d.get("sensor")
        print(f"{TITLES['d']}: " + (", ".join(entry["files"]) if entry else "no sensor entry"), end="")
        det = d.get("detector")
        print("" if entry or not det else f"; detector entry: {', '.join(det['files'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role")
    r = sub.add_parser("rank")  # internal: one rank of a scenario
    r.add_argument("--root", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--scenario", required=True, choices=["a", "b", "c"])
    s = sub.add_parser("spawn")  # internal: scenario b's launcher
    s.add_argument("--root", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--timeout", type=float, default=TIMEOUT_B_S)
    ap.add_argument("--commit", action="append", default=[], help="LABEL=REV (repeatable)")
    ap.add_argument("--out", type=Path, help="results JSON")
    ap.add_argument("--scenarios", default="a,b,c", help="walks to run (a,b,c)")
    ap.add_argument("--lines-only", action="store_true", help="lines and (d) only, no launches")
    ap.add_argument("--keep", action="store_true", help="keep the exported trees and the launches' files")
    args = ap.parse_args()
    if args.role == "rank":
        rank_main(args)
        return 0
    if args.role == "spawn":
        spawn_main(args)
        return 0
    commits = [c.split("=", 1) if "=" in c else [c, c] for c in args.commit or ["before=9e53ee7", "after=HEAD"]]
    scenarios = [] if args.lines_only else [x for x in args.scenarios.split(",") if x]
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="module_walks-"))
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "measures": "lines of ncclguard/ and integrations/; library modules whose functions run in each walk",
        "commits": {},
    }
    try:
        for label, rev in commits:
            commit = resolve(rev)
            print(f"{label} = {rev} = {commit}", flush=True)
            res: dict[str, Any] = {"rev": rev, "commit": commit, "lines": lines_at(commit)}
            res["sensor"] = where_to_add(commit)
            if scenarios:
                res["walks"] = walks_at(commit, scenarios, work)
            results["commits"][label] = res
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["environment"] = {
        "cores": os.cpu_count(),
        "wall_s": round(time.monotonic() - t0, 1),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print_report(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    errors = [s for res in results["commits"].values() for s, w in res.get("walks", {}).items() if "error" in w]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
