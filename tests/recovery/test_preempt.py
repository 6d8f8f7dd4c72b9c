"""Preemption, the parts that need no process group: the stop carried in the commit's statements
and outcome, the SIGTERM handler (a real signal, in a child process), the directory's option and
variable, the stop itself with RecoveringStep's DCP writer (a world of one, loaded back with
``dcp.load``), ``ncclguard run``'s options, and the supervisor told to stop (real processes)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ncclguard
from ncclguard.cli.run import PREEMPT_DIR_VAR as RUN_VAR
from ncclguard.cli.run import plan
from ncclguard.recovery import engine as engine_module
from ncclguard.recovery import preempt
from ncclguard.recovery._commit.statements import CommitOutcome, CommitStatement, decide
from ncclguard.recovery.commit import _COMMITS
from ncclguard.recovery.engine import Adapter
from ncclguard.recovery.options import recovery_options
from ncclguard.store.codec import decode, encode
from ncclguard.supervise.loop import STOPPED_STATUSES, stopped
from ncclguard.world import current_world

# Hang guard for a supervisor's process: it imports torch (~2 s here, ~10 s on a loaded machine).
PROC_GUARD_S = 60.0


@pytest.fixture
def no_request(monkeypatch):
    """This process's stop request starts unset and is put back as it was."""
    monkeypatch.setattr(preempt._REQUESTS, "signum", None)
    monkeypatch.setattr(preempt._REQUESTS, "at", None)


def _statement(rank: int, stop: bool = False) -> CommitStatement:
    return CommitStatement(rank=rank, step=3, generation=0, group="0", group_size=3, seq=7, stop=stop)


def test_one_rank_asking_to_stop_makes_the_outcome_stop_for_every_rank():
    quiet = {r: _statement(r) for r in range(3)}
    asked = {**quiet, 1: _statement(1, stop=True)}
    assert decide(quiet, 3, 3, 5.0).stop is False
    outcome = decide(asked, 3, 3, 5.0)
    assert outcome.ok and outcome.stop  # the step is applied, then every rank stops
    # A failed step still carries it: the redo's commit asks again, from the same rank.
    failing = {**asked, 2: CommitStatement(**{**_statement(2).model_dump(), "problems": ["boom"]})}
    assert not decide(failing, 3, 3, 5.0).ok and decide(failing, 3, 3, 5.0).stop
    # Through the store's codec, and a statement from a rank that never says it (the default).
    assert decode(CommitOutcome, encode(outcome), "outcome", 4096).stop is True
    old = json.loads(encode(_statement(0)))
    old.pop("stop")
    assert decode(CommitStatement, json.dumps(old), "statement", 4096).stop is False


def test_should_commit_carries_this_ranks_request(no_request):
    assert ncclguard.should_commit().stop is False
    preempt.request_stop()
    res = ncclguard.should_commit()
    assert res.ok and res.stop


def test_the_directory_comes_from_the_option_else_the_variable_and_a_file_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(preempt.PREEMPT_DIR_VAR, raising=False)
    assert recovery_options().preempt_dir is None
    assert recovery_options(preempt_dir=tmp_path / "a").preempt_dir == tmp_path / "a"
    monkeypatch.setenv(preempt.PREEMPT_DIR_VAR, str(tmp_path / "b"))
    assert recovery_options().preempt_dir == tmp_path / "b"
    assert recovery_options(preempt_dir=tmp_path / "a").preempt_dir == tmp_path / "a"  # the option wins
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file; name a directory"):
        recovery_options(preempt_dir=afile)
    monkeypatch.setenv(preempt.PREEMPT_DIR_VAR, str(afile))
    with pytest.raises(ValueError, match="NCCLGUARD_PREEMPT_DIR=.* is a file"):
        recovery_options()
    with pytest.raises(TypeError, match="preempt_dir must be a path"):
        recovery_options(preempt_dir=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is empty"):
        recovery_options(preempt_dir="")
    with pytest.raises(ValueError, match="is a file"):
        ncclguard.RecoveringStep(torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1), preempt_dir=afile)
    assert RUN_VAR == preempt.PREEMPT_DIR_VAR  # the launcher spells it without importing torch
    assert preempt.PREEMPTED_STATUS in STOPPED_STATUSES and stopped(-15) and not stopped(1) and not stopped(-9)


HANDLER = """
import json, os, signal, threading
from ncclguard.recovery import preempt
from ncclguard.recovery.commit import _COMMITS
seen = []
signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
other = []
t = threading.Thread(target=lambda: other.append(preempt.install_handler()))
t.start(); t.join()
first = preempt.install_handler()
before = preempt.stop_requested()
os.kill(os.getpid(), signal.SIGTERM)
print(json.dumps({"other_thread": other[0], "installed": first, "before": before,
                  "after": preempt.stop_requested(), "chained": seen, "again": preempt.install_handler()}))
"""


def test_the_handler_notes_sigterm_chains_to_the_one_before_and_only_in_the_main_thread():
    out = subprocess.run([sys.executable, "-c", HANDLER], capture_output=True, text=True, timeout=PROC_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "other_thread": False,
        "installed": True,
        "before": False,
        "after": True,  # the process lives on: the stop waits for the next commit
        "chained": [int(signal.SIGTERM)],
        "again": True,
    }


class _Writer(Adapter):
    name = "writer"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def get_module(self) -> torch.nn.Module:
        return torch.nn.Linear(1, 1)

    def rewrap(self, rebuilt) -> None:
        return None

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        if self.fail:
            raise OSError("disk full")
        (directory / "ck").write_text(str(step))
        return directory / "ck"


class _NoWriter(Adapter):
    name = "nowriter"

    def get_module(self) -> torch.nn.Module:
        return torch.nn.Linear(1, 1)

    def rewrap(self, rebuilt) -> None:
        return None


def test_stop_now_writes_the_checkpoint_and_the_marker_or_says_why_not(tmp_path, caplog):
    codes: list[int] = []
    with pytest.raises(SystemExit):
        preempt.stop_now(_Writer(), tmp_path / "d", 7, end=codes.append)
    assert (tmp_path / "d" / "ck").read_text() == "7"
    marker = decode(preempt.PreemptMarker, (tmp_path / "d" / preempt.MARKER).read_text(), "marker", 4096)
    assert marker == preempt.PreemptMarker(adapter="writer", path=str(tmp_path / "d" / "ck"), step=7, world_size=1)
    with pytest.raises(SystemExit):
        preempt.stop_now(_Writer(), None, 8, end=codes.append)
    assert "no checkpoint written: name a directory with preempt_dir= or NCCLGUARD_PREEMPT_DIR" in caplog.text
    with pytest.raises(SystemExit):
        preempt.stop_now(_Writer(fail=True), tmp_path / "e", 9, end=codes.append)
    assert "writing the checkpoint of step 9 failed" in caplog.text and not (tmp_path / "e" / preempt.MARKER).exists()
    with pytest.raises(SystemExit):  # an adapter with no writer: the stop goes on, nothing written
        preempt.stop_now(_NoWriter(), tmp_path / "f", 1, end=codes.append)
    assert "no checkpoint written on preemption: nowriter has no checkpoint writer" in caplog.text
    assert codes == [143, 143, 143, 143]


def test_recovering_step_stops_at_the_next_step_after_the_agreed_one_with_a_dcp_checkpoint(
    no_request, monkeypatch, tmp_path
):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    codes: list[int] = []
    # This process's world of one keeps the last step= any earlier test committed: start afresh.
    monkeypatch.setattr(current_world().get(_COMMITS), "user_step", None)
    monkeypatch.setattr(engine_module, "stop_now", lambda a, d, s: preempt.stop_now(a, d, s, end=codes.append))
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    stepper = ncclguard.RecoveringStep(module, opt, preempt_dir=tmp_path)
    x = torch.randn(3, 4)
    assert stepper(lambda m: m(x).sum().backward(), step=0)
    preempt.request_stop()
    assert stepper(lambda m: m(x).sum().backward(), step=1).commits[-1].stop  # applied, stop agreed
    state = {k: v.clone() for k, v in module.state_dict().items()}
    exp_avg = opt.state[module.weight]["exp_avg"].clone()
    with pytest.raises(SystemExit):
        stepper(lambda m: m(x).sum().backward(), step=2)  # the loop came back: write, exit
    assert codes == [143] and torch.equal(module.weight, state["weight"])  # step 2 never ran
    marker = json.loads((tmp_path / preempt.MARKER).read_text())
    assert marker["path"] == str(tmp_path / "step-1") and marker["step"] == 1
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    loaded = {"model": msd, "optim": osd, "ncclguard": {"step": torch.tensor(-1)}}
    dcp.load(loaded, checkpoint_id=marker["path"])
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], exp_avg) and int(loaded["ncclguard"]["step"]) == 1


def test_the_checkpoint_says_how_much_of_the_supervisors_grace_it_took(monkeypatch, tmp_path, caplog):
    from ncclguard.recovery._rebuild.restarts import STOP_GRACE_VAR, stop_grace_s

    assert preempt.grace_note(1.0, None, None) == "no supervisor's grace: the launcher's SIGKILL bounds the save"
    assert preempt.grace_note(1.0, 2.0, 8.0) == "2.00 s after the stop, of the supervisor's 8 s grace"
    assert preempt.grace_note(3.0, None, 8.0) == "3.00 s after the stop, of the supervisor's 8 s grace"
    over = preempt.grace_note(3.0, 5.0, 8.0)  # 5 s of 8: the next, larger state may not fit
    assert over.startswith("5.00 s after the stop, of the supervisor's 8 s grace; over half of it: a larger state")
    assert "--ncclguard-stop-grace S" in over and "to at least 10 s" in over
    for raw, want in (("8", 8.0), ("0.5", 0.5), ("0", None), ("-1", None), ("eight", None), ("inf", None)):
        monkeypatch.setenv(STOP_GRACE_VAR, raw)
        assert stop_grace_s() == want, raw
    monkeypatch.setenv(STOP_GRACE_VAR, "8")
    codes: list[int] = []
    with caplog.at_level(logging.WARNING, logger="ncclguard"), pytest.raises(SystemExit):
        preempt.stop_now(_Writer(), tmp_path / "d", 7, end=codes.append)
    assert re.search(
        r"checkpoint of step 7 written to \S+ in \d+\.\d\d s \(.* of the supervisor's 8 s grace\)", caplog.text
    )
    assert codes == [143]


def test_ncclguard_run_sets_the_variable_and_passes_the_grace_to_each_supervisor(tmp_path):
    job = plan(
        ["--ncclguard-restarts", "1", "--ncclguard-stop-grace", "3", "--ncclguard-preempt-dir", "ck", "t.py"], tmp_path
    )
    assert job.env[preempt.PREEMPT_DIR_VAR] == str(tmp_path / "ck")
    assert job.torchrun.training_script_args[:4] == ["--restarts", "1", "--stop-grace", "3.0"]
    with pytest.raises(ValueError, match="goes with --ncclguard-restarts"):
        plan(["--ncclguard-stop-grace", "3", "t.py"], tmp_path)
    with pytest.raises(ValueError, match="must be above 0"):
        plan(["--ncclguard-restarts", "1", "--ncclguard-stop-grace", "0", "t.py"], tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        plan(["--ncclguard-preempt-dir", "f", "t.py"], tmp_path)


SLEEPER = "import time; print('up', flush=True); time.sleep(120)"
DEAF = (  # says the grace its supervisor gave it (NCCLGUARD_STOP_GRACE_S), then ignores SIGTERM
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', os.environ['NCCLGUARD_STOP_GRACE_S'], flush=True); time.sleep(120)"
)
SELF_TERM = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"


def _supervise(code: str, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
    argv = [sys.executable, "-m", "ncclguard.supervise", "--restarts", "2", *extra, "--", sys.executable, "-c", code]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_supervisor_told_to_stop_forwards_kills_after_the_grace_and_never_restarts():
    # Four supervisors at once: a plain script (SIGTERM forwarded), the same sent SIGINT, one that
    # ignores SIGTERM (SIGKILL after the grace), and one whose rank SIGTERMs itself with the
    # supervisor untouched (not restarted).
    plain, interrupted = _supervise(SLEEPER), _supervise(SLEEPER)
    deaf, self_term = _supervise(DEAF, "--stop-grace", "0.5"), _supervise(SELF_TERM)
    for proc, said in ((plain, "up\n"), (interrupted, "up\n"), (deaf, "up 0.5\n")):
        assert proc.stdout is not None and proc.stdout.readline() == said  # the rank runs
    start = time.monotonic()
    for proc in (plain, deaf):
        proc.send_signal(signal.SIGTERM)
    interrupted.send_signal(signal.SIGINT)
    procs = {"plain": plain, "interrupted": interrupted, "deaf": deaf, "self": self_term}
    outs = {name: p.communicate(timeout=PROC_GUARD_S) for name, p in procs.items()}
    took = time.monotonic() - start
    assert plain.returncode == 143 and self_term.returncode == 143
    assert interrupted.returncode == 128 + signal.SIGINT  # the rank's KeyboardInterrupt, not restarted
    assert deaf.returncode == 128 + signal.SIGKILL
    assert took < PROC_GUARD_S / 2  # a hang guard; the grace is 0.5 s
    for name, (_, err) in outs.items():
        assert "; restart" not in err, (name, err)
        assert "told to stop, it stays down" in err, (name, err)
    assert "did not end within 0.5 s of the stop; SIGKILL" in outs["deaf"][1]
    assert "exited -15 after its own stop" in outs["self"][1]


def test_guard_trainer_takes_the_directory_only_with_recover(tmp_path):
    from tiny_trainer import tiny_trainer

    from ncclguard.integrations.hf import find_guard, guard_trainer

    trainer = tiny_trainer(tmp_path)
    with pytest.raises(ValueError, match="preempt_dir needs recover=True"):
        guard_trainer(trainer, preempt_dir=tmp_path / "ck")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        guard_trainer(trainer, recover=True, preempt_dir=tmp_path / "f")
    assert find_guard(trainer) is None  # nothing half-done
    guard_trainer(trainer, recover=True, watchdog=False, preempt_dir=tmp_path / "ck")
    assert find_guard(trainer).recovery.engine.options.preempt_dir == tmp_path / "ck"


LIGHTNING = """
import json, os, signal, sys
from pathlib import Path
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from ncclguard.integrations.lightning import NcclGuardCallback
from ncclguard.recovery import preempt

MODE, OUT = sys.argv[1], Path(sys.argv[2])
seen = {}

class Net(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)
        self.term_at = None
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)
            seen[self.tag] = {"received_sigterm": self.trainer.received_sigterm, "noted": preempt.stop_requested(),
                              "handler": type(signal.getsignal(signal.SIGTERM)).__name__}
            print(json.dumps(seen), flush=True)
        return self.net(batch[0]).square().mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g)), batch_size=4)

class Probe(Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        opt = trainer.optimizers[0]
        state = [v for p in pl_module.parameters() for v in (p, *opt.state[p].values())]
        torch.save([t.detach().clone() for t in state], OUT / f"state-{MODE}.pt")
    def on_train_start(self, trainer, pl_module):
        if MODE == "resume":
            opt, want = trainer.optimizers[0], torch.load(OUT / "state-recover.pt", weights_only=True)
            have = [v for p in pl_module.parameters() for v in (p, *opt.state[p].values())]
            seen["resumed"] = {"step": trainer.global_step, "stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
                               "tensors": len(have),
                               "equal": len(want) == len(have) and all(torch.equal(a, b) for a, b in zip(want, have))}

def fit(tag, callbacks, max_steps, term_at=None, ckpt=None):
    net = Net()
    net.tag, net.term_at = tag, term_at
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="gloo"),
                      max_steps=max_steps, callbacks=[Probe(), *callbacks], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(OUT / tag))
    trainer.fit(net, ckpt_path=ckpt)
    return trainer

if MODE == "recover":
    try:  # no recover=True: Lightning's own handler and its SIGTERMException, unchanged
        fit("plain", [NcclGuardCallback(watchdog=False)], 100, term_at=1)
    except SystemExit as exc:
        seen["plain_exit"] = type(exc).__name__
    print(json.dumps(seen), flush=True)
    fit("recover", [NcclGuardCallback(recover=True, watchdog=False, preempt_dir=OUT / "ck")], 100, term_at=2)
    print("not stopped", flush=True)
else:
    guard = NcclGuardCallback(recover=True, watchdog=False)
    before = signal.getsignal(signal.SIGTERM)
    marker = json.loads((OUT / "ck" / preempt.MARKER).read_text())
    trainer = fit("resume", [guard], marker["step"] + 3, term_at=-1, ckpt=marker["path"])
    seen["after"] = {"handler_back": signal.getsignal(signal.SIGTERM) is before, "engine_handler": before is preempt._handler,
                     "wrappers_left": sorted(vars(trainer._signal_connector).keys() & {"register_signal_handlers", "teardown"}),
                     "step": trainer.global_step}
    print(json.dumps(seen), flush=True)
"""


def _lightning(mode: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.pop(preempt.PREEMPT_DIR_VAR, None)
    argv = [sys.executable, "-c", LIGHTNING, mode, str(out)]
    return subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True, timeout=4 * PROC_GUARD_S)


def test_lightning_sigterm_is_the_engines_during_fit_and_stops_after_the_step_with_a_resumable_ckpt(tmp_path):
    # A world of one (DDP strategy, gloo), SIGTERM to the process itself inside training_step.
    stopped_run = _lightning("recover", tmp_path)
    assert stopped_run.returncode == preempt.PREEMPTED_STATUS, stopped_run.stderr[-4000:]
    seen = json.loads(stopped_run.stdout.splitlines()[-1])
    # Without recover=True: Lightning's composed handler took the signal and its loop raised at the batch's end.
    assert seen["plain"] == {"received_sigterm": True, "noted": False, "handler": "_HandlersCompose"}
    assert seen["plain_exit"] == "SIGTERMException"
    # With it: the engine's handler only noted the request; Lightning never learned of it.
    assert seen["recover"] == {"received_sigterm": False, "noted": True, "handler": "function"}
    assert "not stopped" not in stopped_run.stdout
    marker = json.loads((tmp_path / "ck" / preempt.MARKER).read_text())
    assert marker == {"adapter": "NcclGuardCallback", "path": str(tmp_path / "ck" / "epoch=0-step=3.ckpt"), "step": 2,
                      "world_size": 1}  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["PREEMPTED.json", "epoch=0-step=3.ckpt"]
    resumed = _lightning("resume", tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    seen = json.loads(resumed.stdout.splitlines()[-1])
    # Lightning's resume finds the step applied, its logging counter not counted twice, every tensor equal.
    assert seen["resumed"] == {"step": 3, "stepped": 3, "tensors": 8, "equal": True}  # 2 params, AdamW's 3 each
    # A fit that ends: SIGTERM back to what held it before fit (the engine's), the wrappers gone.
    assert seen["after"] == {"handler_back": True, "engine_handler": True, "wrappers_left": [], "step": 5}


def test_the_lightning_callback_takes_the_directory_only_with_recover(tmp_path):
    from ncclguard.integrations.lightning import NcclGuardCallback

    with pytest.raises(ValueError, match="preempt_dir needs recover=True"):
        NcclGuardCallback(watchdog=False, preempt_dir=tmp_path / "ck")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        NcclGuardCallback(recover=True, watchdog=False, preempt_dir=tmp_path / "f")
    callback = NcclGuardCallback(recover=True, watchdog=False, preempt_dir=tmp_path / "ck")
    assert callback.recovery is not None and callback.recovery.engine.options.preempt_dir == tmp_path / "ck"
