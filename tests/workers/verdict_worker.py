"""Rank side of tests/watching/test_verdict_multirank.py. Usage: verdict_worker.py stuck|busy|upload PORT SECONDS.

Launched as ``ncclguard run --ncclguard-restarts 1`` does it (each rank under its supervisor,
``NCCLGUARD_AUTO=1``: the watchdog with every default), with ``RecoveringStep(allow_shrink=True)``
and no timeout set anywhere: the group keeps gloo's 30 min, the step bound its 300 s default.

``stuck`` (3 ranks): WARM healthy steps (the step bound is learned: its floor), then at step
ASLEEP launch rank 2 sleeps in Python for good; ranks 0-1 go on as a world of 2. At step STOPPED
launch rank 1 publishes heartbeats with no backend count for 6 s (as one published inside the
rebuild's ``init_process_group``), then stops itself (SIGSTOP); rank 0 goes on alone and, once
done, lets it continue (SIGCONT): it finds itself left out and exits 0.

``hf`` (3 ranks): the HF Trainer with ``TrainingArguments``' defaults and ``guard_trainer(trainer,
recover=True, allow_shrink=True)``: at global step ASLEEP launch rank 2 sleeps for good in the
model's forward; ranks 0-1 finish HF_STEPS steps as a world of 2. Then, in the same processes, an
Accelerate loop through ``recovering_step(..., allow_shrink=True)``: at its step ACC_ASLEEP launch
rank 1 sleeps for good and rank 0 finishes alone.

``busy`` (2 ranks): WARM healthy steps, then at step BUSY rank 1 computes in Python for BUSY_S
seconds (its stack and CPU time move): reported, no action; the run ends on its 2 ranks.

``upload`` (3 ranks, ``RecoveringStep(module, opt)`` with every default: under restarts it heals, so a
rank judged stuck would be ended and restarted): WARM healthy steps (the judge bound learned at its
10 s floor), then at step UPLOAD launch rank 0 uploads inside its step function: its main thread
blocked in ``socket.sendall`` of a big buffer to a slow reader in another process (the test's, on
loopback, at the port given after the scenario's name: ``verdict_worker.py upload PORT SECONDS``), for
about the seconds given after the port. Only its network bytes move (its CPU, I/O and stack do not):
reported, no action.

``remote`` (2 ranks, one per host: tests/watching/test_verdict_remote_multirank.py): ``RecoveringStep(heal=True,
allow_shrink=True)``. At step REMOTE_ASLEEP launch rank 1 (host B) stops itself (SIGSTOP): rank 0 (host
A) can neither judge it nor cut it, and asks its supervisor, which ends it and restarts it (heal); the
new process rejoins and is healed. At step REMOTE_STOPPED, in its second life, it stops itself again:
its supervisor, out of restarts, ends it for good and rank 0 finishes alone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put
from recovering_worker import batch, make_module, summary

import ncclguard
from ncclguard import RecoveringStep
from ncclguard.world import current_world

rankkit.rank = lambda: int(os.environ["RANK"])  # a rebuild renumbers; faults go by launch rank

WARM = 12  # steps before the first fault: past the warm-up (10 intervals)
ASLEEP, STOPPED, STEPS = 12, 15, 18
BUSY, BUSY_S, BUSY_STEPS = 12, 15.0, 14
BUSY_STEP_S = 1.0  # busy: each step's work, so that the watchdog's hang bound warms up (10 intervals at 0.5 s ticks)
# 14 steps of REMOTE_STEP_S before the first fault: the hang bound's warm-up (10 intervals) at the
# watchdog's 0.5 s ticks, with room to spare on a loaded machine.
REMOTE_STEP_S, REMOTE_ASLEEP, REMOTE_STOPPED, REMOTE_STEPS = 1.0, 14, 17, 20
UPLOAD, UPLOAD_STEPS = 12, 15
# upload: the slow reader (the test's) reads UPLOAD_CHUNK bytes every UPLOAD_EVERY_S for the upload's
# seconds after it accepts, then drains: the buffer outlasts that, with the kernel's socket buffers.
UPLOAD_CHUNK, UPLOAD_EVERY_S = 64 << 10, 0.05


def upload_bytes(seconds: float) -> int:
    return int(seconds * UPLOAD_CHUNK / UPLOAD_EVERY_S * 1.5) + (16 << 20)


def busy_for(seconds: float) -> int:
    """CPU work in Python for ``seconds``: the stack and the main thread's CPU time move."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += sum(i * i for i in range(2000)) % 7
    return n


def main(mode: str) -> None:
    dist.init_process_group("gloo")  # no timeout: gloo's own 30 min
    me = int(os.environ["RANK"])
    module = make_module()
    stepper = RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.1), allow_shrink=True)
    timing = stepper.engine.timing
    steps = STEPS if mode == "stuck" else BUSY_STEPS
    results, stalls = [], {}
    put("pid", os.getpid())
    rankkit.save()
    for step in range(steps):
        x, y = batch(step, me)

        def step_fn(model: torch.nn.Module, step: int = step, x=x, y=y) -> float:
            if mode == "stuck" and me == 2 and step == ASLEEP:
                rankkit.asleep_for_good()
            if mode == "stuck" and me == 1 and step == STOPPED:
                rankkit.beats_uncounted(6.0)  # the beat that once kept it from being judged (a full run)
                put("stall_at", time.time())
                rankkit.save()
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "busy":
                time.sleep(BUSY_STEP_S)
            if mode == "busy" and me == 1 and step == BUSY:
                rankkit.fault_fired(f"busy in Python for {BUSY_S} s")
                busy_for(BUSY_S)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        before = timing.judge_s()
        t0 = time.time()
        res = stepper(step_fn, step=step)
        results.append({**summary(res), "size": dist.get_world_size(), "elapsed_s": round(time.time() - t0, 3)})
        stalls[step] = {"judge_s": before, "started": t0, "ended": time.time()}
        if not res:
            break
    put("results", results)
    put("steps", stalls)
    put("events", stepper.engine.timing.driver.events)
    put("judge_s", timing.judge_s())
    put("learned", timing.learner.state.model_dump())
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    if mode == "busy":
        put("hang", _learned())
        from ncclguard.watching.watchdog import current_watchdog

        wd = current_watchdog()
        assert wd is not None
        put(
            "incidents",
            [{"kind": i["kind"], "reason": i["doc"]["reason"], "actions": i["actions"]} for i in wd.incidents],
        )
    if mode == "stuck":
        # The learned state in the job's store, as a restarted process reads it.
        from ncclguard.store.learned import LEARNED_KEY

        put("stored", bytes(rankkit._job_store().get(LEARNED_KEY)).decode())
        rankkit.save()
        pid1 = json.loads((Path(os.environ["NCCLGUARD_TEST_OUT"]) / "rank1.json").read_text())["pid"]
        try:
            os.kill(int(pid1), signal.SIGCONT)  # let it find itself left out and exit 0
        except ProcessLookupError:
            pass  # its supervisor ended it already
    rankkit.done()


def _digest(module: torch.nn.Module) -> str:
    import hashlib

    from recovering_worker import flat

    return hashlib.sha256(flat(module).numpy().tobytes()).hexdigest()


def _learned() -> dict:
    """This rank's learned bounds now: the watchdog's hang bound (in force, and per phase) and what it keeps."""
    from ncclguard.watching.watchdog import current_watchdog

    wd = current_watchdog()
    assert wd is not None
    return {"hang_s": wd.hang_bound_s(), "fixed": wd.hang.fixed, "state": wd.hang.learner.state.model_dump()}


def remote() -> None:
    me, life = int(os.environ["RANK"]), ncclguard.restart_count()
    if life == 0:
        dist.init_process_group("gloo")  # no timeout: gloo's own 30 min
    module = make_module()
    stepper = RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.1), allow_shrink=True, heal=True)
    timing = stepper.engine.timing
    put("pid", os.getpid())
    put("life", life)
    put("resume_step", stepper.resume_step)
    rankkit.save()
    results, stalls = [], {}
    for step in range(stepper.resume_step or 0, REMOTE_STEPS):
        x, y = batch(step, me)
        if me == 1 and step == (REMOTE_ASLEEP if life == 0 else REMOTE_STOPPED):
            rankkit.fault_fired(f"stopped (SIGSTOP) at step {step}")
            put("results", results)
            put("steps", stalls)
            put("hang", _learned())
            put("stall_at", time.time())
            rankkit.save()
            os.kill(os.getpid(), signal.SIGSTOP)  # on host B: nobody on host A can judge or cut it

        def step_fn(model: torch.nn.Module, x=x, y=y) -> float:
            time.sleep(REMOTE_STEP_S)  # the step's work: the watchdog's tick (0.5 s) sees each step's op
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        before, t0 = timing.judge_s(), time.time()
        res = stepper(step_fn, step=step)
        row = {**summary(res), "size": dist.get_world_size(), "elapsed_s": round(time.time() - t0, 3)}
        results.append({**row, "step": step, "healed": res.healed is not None and bool(res.healed.ok)})
        stalls[step] = {"judge_s": before, "after_s": timing.judge_s(), "started": t0}
        if step == REMOTE_STOPPED - 1:
            put("digest", _digest(module))  # rank 0 and the healed rank 1 hold the same parameters
        if not res:
            break
    put("results", results)
    put("steps", stalls)
    put("events", timing.driver.events)
    put("judge_s", timing.judge_s())
    put("hang", _learned())
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    from ncclguard.store.learned import LEARNED_KEY, hang_key

    put("stored", bytes(rankkit._job_store().get(LEARNED_KEY)).decode())
    job = rankkit._job_store()
    put("stored_hang", {o: bytes(job.get(hang_key(o))).decode() for o in (0, 1) if job.check([hang_key(o)])})
    rankkit.done()


def send_slowly(port: int, data: bytes) -> dict[str, float]:
    """An upload: ``data`` sent with ``sendall`` to the slow reader at ``port`` on loopback, the main
    thread blocked in it until the reader has drained it (only the socket's bytes move)."""
    import socket

    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.monotonic()
        s.sendall(data)  # blocked here while the reader takes 64 KiB every 50 ms
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the reader closes once it has read everything: the upload is done
        return {"s": round(time.monotonic() - t0, 3), "bytes": len(data)}


def upload(port: int, seconds: float) -> None:
    me, life = int(os.environ["RANK"]), ncclguard.restart_count()
    rankkit.rank = lambda: me + 10 * life  # a restarted process (a rank wrongly acted on) saves apart
    dist.init_process_group("gloo")  # no timeout: gloo's own 30 min
    module = make_module()
    stepper = RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.1))  # every default
    timing = stepper.engine.timing
    data = bytes(upload_bytes(seconds)) if me == 0 else b""  # made before the step: the step only sends it
    put("pid", os.getpid())
    put("life", life)
    put("heal", stepper.engine.options.heal)
    put("plan", [UPLOAD, UPLOAD_STEPS])
    rankkit.save()
    results, stalls = [], {}
    for step in range(UPLOAD_STEPS):
        x, y = batch(step, me)

        def step_fn(model: torch.nn.Module, step: int = step, x=x, y=y) -> float:
            if me == 0 and step == UPLOAD:
                rankkit.fault_fired("a slow upload inside the step")
                put("upload_at", time.time())
                rankkit.save()
                put("upload", send_slowly(port, data))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        before, t0 = timing.judge_s(), time.time()
        res = stepper(step_fn, step=step)
        results.append({**summary(res), "size": dist.get_world_size(), "elapsed_s": round(time.time() - t0, 3)})
        stalls[step] = {"judge_s": before, "started": t0, "ended": time.time()}
        if not res:
            break
    put("results", results)
    put("steps", stalls)
    put("events", timing.driver.events)
    put("judge_s", timing.judge_s())
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    from ncclguard.watching.watchdog import current_watchdog

    wd = current_watchdog()
    assert wd is not None
    put("incidents", [{"kind": i["kind"], "actions": i["actions"]} for i in wd.incidents])
    rankkit.done()


HF_STEPS = 16


def hf() -> None:
    from hf_parts import Dataset, cpu_arguments, tiny_bert
    from transformers import Trainer

    from ncclguard.integrations.hf import find_guard, guard_trainer

    me = int(os.environ["RANK"])
    out = os.environ["NCCLGUARD_TEST_OUT"]
    torch.manual_seed(0)
    model = tiny_bert()
    holder: dict[str, Trainer] = {}

    def asleep(_module: torch.nn.Module, _inputs: object) -> None:
        if me == 2 and holder["t"].state.global_step == ASLEEP:
            rankkit.asleep_for_good()

    model.register_forward_pre_hook(asleep)
    args = cpu_arguments(f"{out}/hf", HF_STEPS)
    t = holder["t"] = Trainer(model=model, args=args, train_dataset=Dataset(96, seed=1))
    guard_trainer(t, recover=True, allow_shrink=True)  # nothing else: every timeout at its default
    put("pid", os.getpid())
    rankkit.save()
    t0 = time.time()
    t.train()
    engine = find_guard(t).recovery.engine  # type: ignore[union-attr]
    put("global_step", t.state.global_step)
    put("recoveries", [{"step": r.step, "s": r.elapsed_s, "world_size": r.world_size} for r in engine.recoveries])
    put("events", engine.timing.driver.events)
    put("judge_s", engine.timing.judge_s())
    put("train_s", round(time.time() - t0, 3))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.save()
    accelerate_after(me)


ACC_ASLEEP, ACC_STEPS = 3, 6


def accelerate_after(me: int) -> None:
    """After the Trainer, in the same processes (ranks 0-1, a world of 2): an Accelerate loop through
    ``recovering_step(accelerator, model, opt, allow_shrink=True)``, nothing else set. At its step
    ACC_ASLEEP launch rank 1 sleeps for good; rank 0 finishes alone. Its engine is new: its judge
    bound comes from the job's store, learned by the Trainer's engine (no warm-up of its own)."""
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import recovering_step

    accelerator = Accelerator(cpu=True)  # the Trainer's state: this world of 2
    module = make_module()
    model, opt = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    stepper = recovering_step(accelerator, model, opt, allow_shrink=True)  # every timeout at its default
    timing = stepper.engine.timing
    results, judge = [], []
    for step in range(ACC_STEPS):
        x, y = batch(step, me)

        def step_fn(m: torch.nn.Module, step: int = step, x=x, y=y) -> None:
            if me == 1 and step == ACC_ASLEEP:
                rankkit.asleep_for_good("accelerate_stall_at")
            accelerator.backward(torch.nn.functional.mse_loss(m(x), y))

        t0 = time.time()
        res = stepper(step_fn, step=step)
        judge.append(timing.judge_s())
        results.append({**summary(res), "size": dist.get_world_size(), "elapsed_s": round(time.time() - t0, 3)})
        if not res:
            break
    put(
        "accelerate",
        {
            "results": results,
            "judge_s": judge,
            "events": timing.driver.events,
            "processes": [accelerator.num_processes, accelerator.process_index],
            "final": [dist.get_rank(), dist.get_world_size(), current_world().generation],
        },
    )
    rankkit.done()


if __name__ == "__main__":
    if sys.argv[1] == "hf":
        hf()
    elif sys.argv[1] == "remote":
        remote()
    elif sys.argv[1] == "upload":
        upload(int(sys.argv[2]), float(sys.argv[3]))
    else:
        main(sys.argv[1]) if sys.argv[1] in ("stuck", "busy") else sys.exit(f"unknown scenario {sys.argv[1]}")
