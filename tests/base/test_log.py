"""ncclguard's own lines reach the user under ``ncclguard run`` (issue 62, item 3): ``show_on_stderr``
prints them at INFO and above on stderr while the script configures no logging, and stays silent
once it does (its handlers print them, once). One subprocess: pytest's own logging capture gives the
root logger handlers, which is the case the handler must stay silent in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from ncclguard._log import log, show_on_stderr
    show_on_stderr()
    show_on_stderr()  # a second call adds no second handler
    log.info("first, unconfigured")
    log.debug("not shown at INFO")
    print("--configured--", file=sys.stderr, flush=True)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="ROOT %(name)s %(levelname)s %(message)s")
    log.warning("second, configured")
    """
)


def _run(level: str | None) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(p for p in sys.path if p)}
    if level is not None:
        env["NCCLGUARD_LOG_LEVEL"] = level
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stderr.splitlines() if "Warning" not in line and line.strip()]


def test_lines_at_info_until_the_script_configures_logging_then_once_through_its_handlers() -> None:
    lines = _run(None)
    before, after = lines[: lines.index("--configured--")], lines[lines.index("--configured--") + 1 :]
    assert len(before) == 1 and before[0].endswith(" ncclguard INFO [rank ?] first, unconfigured"), lines
    assert after == ["ROOT ncclguard WARNING [rank ?] second, configured"], lines  # once, not twice


def test_the_level_is_the_users_and_a_bad_one_is_named() -> None:
    lines = _run("debug")
    assert any(line.endswith(" ncclguard DEBUG [rank ?] not shown at INFO") for line in lines), lines
    lines = _run("loud")
    assert lines[0].endswith(
        " ncclguard WARNING [rank ?] NCCLGUARD_LOG_LEVEL='LOUD' is no logging level (DEBUG, INFO, WARNING, ERROR); "
        "INFO is used"
    ), lines
    assert any(line.endswith(" ncclguard INFO [rank ?] first, unconfigured") for line in lines), lines
