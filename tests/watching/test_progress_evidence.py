"""Progress evidence beyond the main thread (ncclguard/watching/sensors/progress.py): the CPU of the
other threads and of the process tree, network bytes, ``read``/``write`` bytes. Pure logic on
samples and on ``/proc`` and netlink fixtures written here, then real processes read from ``/proc``:
one that only moves network bytes, one that only sleeps, one whose child burns CPU, one whose
second thread does. Bounds are hang guards, never speed targets."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from ncclguard.incidents.model import Heartbeat
from ncclguard.testing.launch import free_port
from ncclguard.watching.sensors.progress import (
    IO_WAIT_S,
    NET_RATE,
    BlockedIO,
    Progress,
    Sample,
    parse_proc_net_tcp,
    parse_sock_diag,
    sample_process,
    socket_inode,
)

# /proc/<pid>/net/tcp as the kernel writes it: tx_queue:rx_queue is column 5, the inode column 10.
NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000 100 0 0 10 0
   1: 0100007F:A1B2 0100007F:1F90 01 0003A000:00000010 01:00000014 00000000     0        0 5151 2 0000 20 4 30 10 -1
   2: 0100007F:A1B3 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 6161 2 0000 20 4 30 10 -1
   3: garbage
"""


def _diag_message(inode: int, acked: int, received: int, info_len: int = 232) -> bytes:
    """One netlink message: an ``inet_diag_msg`` with an ``INET_DIAG_INFO`` attribute."""
    body = bytearray(72)
    struct.pack_into("=I", body, 68, inode)
    info = bytearray(max(info_len, 136))
    struct.pack_into("=QQ", info, 120, acked, received)
    info = info[:info_len]
    attr = struct.pack("=HH", 4 + len(info), 2) + bytes(info)
    attr += bytes(-len(attr) % 4)
    payload = bytes(body) + attr
    return struct.pack("=IHHII", 16 + len(payload), 20, 2, 1, 0) + payload


def test_proc_net_tcp_rows_give_each_sockets_queues_and_garbage_is_skipped() -> None:
    assert parse_proc_net_tcp(NET_TCP) == {4242: 0, 5151: 0x3A000 + 0x10, 6161: 0}
    assert parse_proc_net_tcp(NET_TCP, {5151}) == {5151: 0x3A010}
    assert parse_proc_net_tcp("") == {} and parse_proc_net_tcp("header\nx y z") == {}
    assert socket_inode("socket:[5151]") == 5151
    assert socket_inode("pipe:[12]") is None and socket_inode("socket:[x]") is None
    assert socket_inode("/dev/null") is None


def test_a_sock_diag_answer_gives_bytes_acked_plus_received_and_stops_at_done() -> None:
    done = struct.pack("=IHHII", 20, 3, 2, 1, 0) + bytes(4)
    data = _diag_message(11, 1000, 24) + _diag_message(12, 5, 0) + done
    assert parse_sock_diag(data) == ({11: 1024, 12: 5}, True)
    assert parse_sock_diag(data, {12}) == ({12: 5}, True)
    assert parse_sock_diag(_diag_message(11, 1, 1)) == ({11: 2}, False)  # more to come
    short = _diag_message(13, 9, 9, info_len=64)  # an old kernel's tcp_info without the byte counters
    assert parse_sock_diag(short + done) == ({}, True)
    assert parse_sock_diag(b"\x05\x00") == ({}, False)
    assert parse_sock_diag(struct.pack("=IHHII", 9999, 20, 2, 1, 0))[1] is True  # a length past the end


def _look(prog: Progress, times: range, **fields: object) -> None:
    for t in times:
        prog.observe(Sample(float(t), "process", cpu_s=1.0, **{k: f(t) for k, f in fields.items()}))  # type: ignore[operator]


def test_threads_children_net_and_read_write_bytes_are_movement_each_named() -> None:
    upload = Progress(10.0)  # main thread blocked in send(): only the socket's bytes move
    _look(upload, range(0, 31, 1), net=lambda t: ((7, t * 200_000.0),))
    j = upload.judge(30.0)
    assert j.state == "moving" and "net +0.2 MB" in j.evidence
    trickle = Progress(10.0)  # a watchdog's store traffic: a few kB a second is no movement
    _look(trickle, range(0, 31, 1), net=lambda t: ((7, t * 3000.0),))
    j = trickle.judge(30.0)
    assert j.state == "stuck" and j.evidence == "nothing moved for 30.0 s (cpu, net)"
    assert 3000 < NET_RATE
    loader = Progress(10.0)  # DataLoader workers decode while the main thread waits
    _look(loader, range(0, 31, 1), children_cpu=lambda t: ((100, t * 0.5), (101, 2.0)))
    assert loader.judge(30.0).state == "moving" and "children cpu +0.50 s" in loader.judge(30.0).evidence
    churn = Progress(10.0)  # a new child is a baseline, a child gone takes nothing away
    _look(churn, range(0, 31, 1), children_cpu=lambda t: ((1000 + t, 50.0),))
    assert churn.judge(30.0).state == "stuck"
    thread = Progress(10.0)  # an upload thread compressing
    _look(thread, range(0, 31, 1), threads_cpu_s=lambda t: t * 0.8)
    assert thread.judge(30.0).state == "moving" and "threads cpu +0.80 s in 1.0 s" in thread.judge(30.0).evidence
    watchdog = Progress(10.0)  # a heartbeat thread's CPU is no movement
    _look(watchdog, range(0, 31, 1), threads_cpu_s=lambda t: t * 0.01)
    assert watchdog.judge(30.0).state == "stuck"
    bursts = Progress(10.0)  # ncclguard's own threads writing a statement: bursts of 2 looks
    _look(bursts, range(0, 31, 1), threads_cpu_s=lambda t: (t // 4) * 0.5 + (0.25 if t % 4 == 1 else 0.0))
    assert bursts.judge(30.0).state == "stuck"
    pipe = Progress(10.0)  # write() to a pipe or socket: rchar/wchar
    _look(pipe, range(0, 31, 1), chars=lambda t: t * (1 << 20))
    assert pipe.judge(30.0).state == "moving" and "io read/write +1.0 MB" in pipe.judge(30.0).evidence
    queues = Progress(10.0)  # another network namespace: only the queues are seen
    _look(queues, range(0, 31, 1), net_queues=lambda t: ((7, float(t % 3)),))
    assert queues.judge(30.0).state == "moving" and "net queues changed on 1 socket(s)" in queues.judge(30.0).evidence
    still = Progress(10.0)
    _look(
        still,
        range(0, 31, 1),
        threads_cpu_s=lambda t: 3.0,
        children_cpu=lambda t: ((100, 1.0),),
        net=lambda t: ((7, 10.0),),
        chars=lambda t: 5,
        io_bytes=lambda t: 0,
        ops=lambda t: 12,
        site=lambda t: "a.py:3",
    )
    j = still.judge(30.0)
    assert j == j.__class__("stuck", 30.0, "nothing moved for 30.0 s (cpu, threads, children, net, io, ops, stack)")


# The real processes: each says "ready" once it does only what it is for.
SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"
SENDER = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    print("ready", flush=True)
    s.sendall(b"x" * (1 << 30))  # blocked here: the peer reads slowly
    """
)
PARENT_OF_BURNER = textwrap.dedent(
    """
    import subprocess, sys, time
    burner = subprocess.Popen([sys.executable, "-c", "import time\\nprint('ready', flush=True)\\nwhile True: pass"],
                              stdout=subprocess.PIPE)
    burner.stdout.readline()
    print("ready", flush=True)
    try:
        time.sleep(120)
    finally:
        burner.kill()
    """
)
THREAD_BURNER = textwrap.dedent(
    """
    import threading, time
    def burn():
        while True:
            sum(range(1000))
    threading.Thread(target=burn, daemon=True).start()
    print("ready", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def spawn() -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(code: str, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        return proc

    yield start
    for proc in procs:  # the whole tree: a parent killed first leaves its child burning (its finally never runs)
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for child in tree:
            try:
                child.kill()
            except psutil.Error:
                pass
        proc.kill()
        proc.wait(timeout=60)


def _judge_from_proc(pid: int, want: str, naming: str = "", still_s: float = 2.0, bound_s: float = 60.0) -> str:
    """Samples ``pid`` every 0.4 s until it is judged ``want`` on evidence that says ``naming``
    (with samples over at least ``still_s`` + 1 s); returns the evidence. ``bound_s`` is a hang
    guard (a loaded machine may make its main thread's kernel work count as CPU at some looks)."""
    prog = Progress(still_s)
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        s = sample_process(pid)
        assert s is not None and not s.stopped
        prog.observe(s)
        j = prog.judge(s.at)
        if j.state == want and naming in j.evidence and s.at - start >= still_s + 1.0:
            return j.evidence
        time.sleep(0.4)
    raise AssertionError(f"pid {pid} not judged {want} within {bound_s} s: {prog.judge(time.monotonic())}")


def test_a_process_blocked_in_sendall_to_a_slow_reader_is_moving_by_its_network_bytes(spawn) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def read_slowly() -> None:
        conn, _ = server.accept()
        with conn:
            while not stop.is_set():
                conn.recv(64 << 10)
                time.sleep(0.2)

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    try:
        proc = spawn(SENDER, str(server.getsockname()[1]))
        evidence = _judge_from_proc(proc.pid, "moving", "net +")
        assert "net +" in evidence, evidence
    finally:
        stop.set()
        server.close()


def test_a_process_that_only_sleeps_is_stuck_with_every_kind_of_evidence_named(spawn) -> None:
    proc = spawn(SLEEPER)
    evidence = _judge_from_proc(proc.pid, "stuck")
    assert evidence.startswith("nothing moved for ") and "(cpu, threads, children, net, io, blocked-io)" in evidence, (
        evidence
    )


def test_a_process_whose_child_burns_cpu_is_moving(spawn) -> None:
    proc = spawn(PARENT_OF_BURNER)
    evidence = _judge_from_proc(proc.pid, "moving", "children cpu +")
    assert "children cpu +" in evidence, evidence


def test_a_process_whose_second_thread_burns_cpu_is_moving(spawn) -> None:
    proc = spawn(THREAD_BURNER)
    evidence = _judge_from_proc(proc.pid, "moving", "threads cpu +")
    assert "threads cpu +" in evidence, evidence


def test_a_process_gone_is_stopped_and_an_unreadable_piece_is_no_evidence(spawn, monkeypatch) -> None:
    proc = spawn(SLEEPER)
    proc.kill()
    proc.wait(timeout=60)
    gone = sample_process(proc.pid)
    assert gone is not None and gone.stopped
    import ncclguard.watching.sensors.proc_reading as reading

    def denied(pid: int) -> list[int]:
        raise PermissionError("denied")

    alive = spawn(SLEEPER)
    monkeypatch.setattr(reading, "_tree", denied)
    s = sample_process(alive.pid)
    assert s is not None and s.children_cpu is None and s.cpu_s is not None


def test_behind_is_told_by_the_whole_world_group_where_a_peer_is_behind() -> None:
    from ncclguard.recovery._verdict.levers import pick_world_group

    # DeepSpeed runs its collectives on its copy "1" of the world "0": "0" stands at 3 everywhere.
    mine = {"0": 3, "1": 57}
    assert pick_world_group(mine, [{"0": 3, "1": 56}, {"0": 3, "1": 57}], "0") == "1"  # a peer behind in "1"
    assert pick_world_group(mine, [{"0": 3, "1": 58}], "0") == "1"  # ahead there: this rank checks itself
    assert pick_world_group(mine, [{"0": 3, "1": 57}, None], "0") == "0"  # nothing tells them apart
    assert pick_world_group(mine, [{"0": 3, "1": 57}], "0", last="1") == "1"  # kept: its own count does not jump
    assert pick_world_group(mine, [{"0": 2, "1": 56}, {"0": 3, "1": 56}], "0") == "1"  # the most peers behind
    assert pick_world_group(mine, [{"0": 2, "1": 56}], "0", last="1") == "1"  # a tie goes to the last pick
    assert pick_world_group(mine, [{"0": 2, "1": 56}], "0") == "0"  # then to the default group
    assert pick_world_group({"0": 3}, [{"1": 0}], "0") == "0"  # a group this rank is not in is no evidence


def test_a_peer_whose_beat_has_no_count_in_the_group_is_neither_behind_nor_level() -> None:
    from ncclguard.recovery._verdict.levers import Standing, standing

    # Rank 1 beat once inside the rebuild's init_process_group (no group yet: {}), then stopped. Read
    # as level, it was never judged and its peer waited out the step bound (a full run here, once).
    got = standing({1: {}, 2: {"0": 9}, 3: {"0": 11}, 4: None, 5: {"7": 2}, 6: {"0": 10}}, "0", 10)
    assert (got.behind, got.ahead, got.uncounted) == ({2}, {3}, {1, 4, 5})
    assert 6 not in got.behind | got.ahead | got.uncounted  # level: waits in the same op
    assert standing({}, "0", 3) == Standing(frozenset(), frozenset(), frozenset())  # no peer beat yet


def test_only_the_peers_furthest_behind_are_judged_a_peer_between_may_wait_for_them() -> None:
    from ncclguard.recovery._verdict.levers import standing

    # The stuck drill, 4 ranks, rank 2 SIGSTOPped before its step's broadcast of DDP's buffers: rank 0
    # waits in that broadcast (relayed through rank 2), ranks 1 and 3 went on into the backward. Rank 2's
    # last beat carries its count (stale: it stopped); rank 0 is behind rank 3 but ahead of rank 2.
    got = standing({0: {"0": 41}, 1: {"0": 45}, 2: {"0": 40}}, "0", 45)
    assert (got.behind, got.furthest, got.ahead) == ({0, 2}, {2}, set())
    # Several at the lowest count: each is judged; none behind: none.
    assert standing({0: {"0": 40}, 1: {"0": 45}, 2: {"0": 40}}, "0", 45).furthest == {0, 2}
    assert standing({0: {"0": 45}, 1: {"0": 46}}, "0", 45).furthest == frozenset()


WORLD_OF_ONE = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from ncclguard.recovery._verdict import levers
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
    copy = dist.new_group(backend="gloo")  # what deepspeed.comm makes at initialize
    for _ in range(3):
        dist.all_reduce(torch.ones(1), group=copy)
    default, mine = levers.world_groups()
    print(default, sorted(mine.items()), levers.world_seq())
    dist.destroy_process_group()
    """
)


def test_world_groups_lists_every_copy_of_the_world_with_its_number() -> None:
    port = free_port()
    env = {**os.environ, "PORT": str(port)}
    out = subprocess.run([sys.executable, "-c", WORLD_OF_ONE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    # No peer to tell them apart: the default group, as before.
    assert out.stdout.strip() == "0 [('0', 0), ('1', 3)] ('0', 0)"


# --- a peer on another host: what its heartbeat carries ------------------------------------------------


def _beat(n: int, **evidence: object) -> Heartbeat:
    fields = dict(rank=1, host="b", pid=7, beat=n, time=0.0, phase="", site="train.py:9", last_seq={})
    return Heartbeat(**fields, last_completed={}, inflight=[], backend_seq={"0": 12}, **evidence)


def test_a_peer_on_another_host_is_judged_from_what_its_heartbeat_carries() -> None:
    """Its main thread still (blocked in send(), waiting on its DataLoader's workers): moving by the
    bytes or the children its beats carry, as a peer of this host is by /proc; stuck once they stop."""
    from ncclguard.watching.sensors.progress import beat_sample

    def judge(beats: list[Heartbeat], at: float) -> str:
        prog = Progress(10.0)
        for i, hb in enumerate(beats):
            prog.observe(beat_sample(hb, i * 5.0))
        j = prog.judge(at)
        return f"{j.state}: {j.evidence}"

    upload = [_beat(i, main_cpu_s=1.0, io_bytes=0, net_bytes=i * 5_000_000, chars=0) for i in range(4)]
    assert judge(upload, 16.0).startswith("moving") and "net +5.0 MB" in judge(upload, 16.0)
    workers = [_beat(i, main_cpu_s=1.0, io_bytes=0, children_cpu=[(40, 4.0 * i), (41, 4.0 * i)]) for i in range(6)]
    assert judge(workers, 26.0).startswith("moving") and "children cpu" in judge(workers, 26.0)
    still = [
        _beat(i, main_cpu_s=1.0, io_bytes=0, net_bytes=10_000, children_cpu=[(40, 2.0)], chars=5) for i in range(4)
    ]
    verdict = judge(still, 16.0)
    assert verdict.startswith("stuck") and "net" in verdict and "children" in verdict, verdict
    # Bounded and sent as JSON: a beat carries at most 64 processes of its tree.
    with pytest.raises(ValueError):
        _beat(0, children_cpu=[(i, 0.0) for i in range(65)])
    assert Heartbeat.model_validate_json(upload[3].model_dump_json()).net_bytes == 15_000_000


def test_a_rank_reads_its_own_tree_sockets_and_children_into_its_heartbeat() -> None:
    """beat_evidence(), as the watchdog's heartbeat calls it: this process's sockets' bytes grow by what
    it sent over loopback TCP; its child's CPU is listed by pid."""
    from ncclguard.watching.sensors.progress import beat_evidence

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import ncclguard.watching.sensors.proc_reading as reading

        with reading._cache_lock:  # a host dump of an earlier test (0.5 s ago) lacks these sockets
            reading._cache.clear()
        before = beat_evidence()
        got = []
        reader = threading.Thread(target=lambda: got.append(_read_all(peer, 4 << 20)), daemon=True)
        reader.start()  # a reader beside the send: loopback buffers hold less than 4 MiB
        client.sendall(b"x" * (4 << 20))
        reader.join(timeout=60)  # a hang guard
        assert got == [4 << 20]
        time.sleep(0.6)  # the host's socket dump is shared for 0.5 s (progress.py): a fresh one
        after = beat_evidence()
        assert before["net_bytes"] is not None and after["net_bytes"] - before["net_bytes"] >= 4 << 20, (before, after)
        assert child.pid in {pid for pid, _ in after["children_cpu"]}
        assert isinstance(after["chars"], int)
    finally:
        child.kill()
        child.wait()
        for s in (client, peer, server):
            s.close()


def _read_all(sock: socket.socket, n: int) -> int:
    got = 0
    while got < n:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    return got


# --- a thread asleep in file I/O: a save's close() on network storage ----------------------------------


def _io(prog: Progress, times: range, *waits: BlockedIO, stopped: bool = False) -> None:
    for t in times:
        prog.observe(Sample(float(t), "process", cpu_s=1.0, io_bytes=0, chars=0, blocked_io=waits, stopped=stopped))


CLOSE = BlockedIO("close", "/mnt/ckpt/model.pt", 7, "request_wait_answer")


def test_a_rank_asleep_in_close_on_network_storage_is_busy_under_its_own_bound_then_stuck() -> None:
    save = Progress(10.0)  # nothing else moves for 47 s: no CPU, no byte counter
    _io(save, range(48), CLOSE)
    j = save.judge(47.0)
    assert j == j.__class__(
        "moving", 0.0, "blocked in close() on /mnt/ckpt/model.pt for 47.0 s (file I/O: busy for up to 1800 s)"
    )
    assert save.io_s == IO_WAIT_S == 1800.0
    hung = Progress(10.0, io_s=60.0)  # a server gone for good: the same wait past its bound
    _io(hung, range(76), CLOSE)
    assert hung.judge(65.0).state == "moving" and "blocked in close()" in hung.judge(65.0).evidence
    j = hung.judge(75.0)
    assert j.state == "stuck" and "blocked-io" in j.evidence, j
    assert j.evidence.endswith("; blocked in close() on /mnt/ckpt/model.pt for 75.0 s, past the file I/O bound of 60 s")
    off = Progress(10.0, io_s=0.0)  # 0: file I/O never counts
    _io(off, range(31), CLOSE)
    assert off.judge(30.0).state == "stuck"
    stopped = Progress(10.0)  # SIGSTOPped in the wait: stopped wins
    _io(stopped, range(31), CLOSE, stopped=True)
    assert stopped.judge(30.0).state == "stuck" and "stopped" in stopped.judge(30.0).evidence


def test_the_end_of_a_wait_is_movement_and_another_wait_starts_its_own_clock() -> None:
    done = Progress(10.0)  # the close returned, and the rank went on to a barrier: its peers come
    _io(done, range(21), CLOSE)
    _io(done, range(21, 25))
    j = done.judge(24.0)
    assert j.state == "moving" and "close() on /mnt/ckpt/model.pt ended after 21.0 s" in j.evidence, j
    assert done.judge(32.0).state == "stuck"  # and nothing after it
    shards = Progress(10.0, io_s=30.0)  # a sharded save: one slow close a file, each its own wait
    _io(shards, range(26), CLOSE)
    _io(shards, range(26, 51), CLOSE._replace(path="/mnt/ckpt/shard-1.pt"))
    assert shards.judge(50.0).evidence.startswith("blocked in close() on /mnt/ckpt/shard-1.pt for 24.0 s")
    # Samples that did not read the threads (a heartbeat of this host) keep the wait; a stale one counts no more.
    stale = Progress(10.0)
    _io(stale, range(5), CLOSE)
    for t in range(5, 31):
        stale.observe(Sample(float(t), "heartbeat", ops=3, cpu_s=1.0))
    assert stale.judge(14.0).state == "moving" and stale.judge(30.0).state == "stuck"


def test_the_io_bound_is_read_from_the_environment(monkeypatch) -> None:
    from ncclguard.watching.sensors.progress import IO_WAIT_VAR, io_wait_bound

    monkeypatch.setenv(IO_WAIT_VAR, "120")
    assert Progress(10.0).io_s == io_wait_bound() == 120.0
    monkeypatch.setenv(IO_WAIT_VAR, "0")
    assert io_wait_bound() == 0.0
    for wrong in ("soon", "-5", "inf"):
        monkeypatch.setenv(IO_WAIT_VAR, wrong)
        assert io_wait_bound() == IO_WAIT_S


def test_a_peer_on_another_host_asleep_in_close_says_so_in_its_heartbeat() -> None:
    from ncclguard.watching.sensors.progress import beat_evidence, beat_sample

    wait = {"call": "close", "path": "/mnt/ckpt/model.pt", "tid": 7, "wait": "request_wait_answer"}
    beats = [_beat(i, main_cpu_s=1.0, io_bytes=0, readings={"blocked-io": wait}) for i in range(10)]
    prog = Progress(10.0)
    for i, hb in enumerate(beats):
        prog.observe(beat_sample(Heartbeat.model_validate_json(hb.model_dump_json()), i * 5.0))
    j = prog.judge(46.0)
    assert j.state == "moving" and j.evidence.startswith("blocked in close() on /mnt/ckpt/model.pt for 46.0 s"), j
    assert beat_sample(_beat(0, chars=5), 0.0).blocked_io == ()  # beat_evidence() read it: none
    assert beat_sample(_beat(0), 0.0).blocked_io is None  # a beat that tells nothing of its threads
    assert beat_sample(_beat(0, readings={"blocked-io": {"call": 1}}), 0.0).blocked_io is None
    assert "readings" not in beat_evidence()  # this process: no thread in file I/O, nothing added
    hb = Heartbeat(**{**_beat(0).model_dump(), "readings": {"blocked-io": wait}})  # as a sensor's figures
    assert beat_sample(hb, 0.0).blocked_io == (BlockedIO("close", "/mnt/ckpt/model.pt", 7, "request_wait_answer"),)
