"""The micro-batch window of the adapter toolkit: recorded, checked and replayed without a framework."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest

from ncclguard.toolkit import Micro, check_window, replay_window


def test_a_window_replays_each_micro_batch_with_the_sync_state_it_had() -> None:
    seen: list[tuple[str, bool, bool]] = []
    flag = {"sync": True, "no_sync": False}

    def step_fn(model: str, batch: str) -> str:
        seen.append((batch, flag["sync"], flag["no_sync"]))
        return f"{model}:{batch}"

    @contextmanager
    def no_sync(model: str) -> Any:
        flag["no_sync"] = True
        try:
            yield
        finally:
            flag["no_sync"] = False

    window = [
        Micro.record(step_fn, ("a",), sync_gradients=False, grad_sync=False),
        Micro.record(step_fn, ("b",), sync_gradients=True, grad_sync=True),
    ]
    check_window(window)
    flag["sync"] = False
    out = replay_window(window, lambda: "m", set_sync_gradients=lambda v: flag.update(sync=v), no_sync=no_sync)
    assert out == ["m:a", "m:b"]
    assert seen == [("a", False, True), ("b", True, False)]
    assert flag["sync"] is True  # left as the window's last micro-batch had it


def test_a_step_fn_over_a_loop_variable_is_refused() -> None:
    batch = "a"
    window = [Micro.record(lambda model: (model, batch), (), sync_gradients=False, grad_sync=False)]
    batch = "b"  # the lambda above would read this one in a redo
    window.append(Micro.record(lambda model: model, (), sync_gradients=True, grad_sync=True))
    with pytest.raises(ValueError, match="micro-batch 0 of this window reads batch from outside"):
        check_window(window)
