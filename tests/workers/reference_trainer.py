"""A minimal DeepSpeed trainer of the seeds' shape, for the example, the tests and the benchmarks.

Shape (what :func:`ncclguard.integrations.deepspeed.patch_trainer` expects): ``.model`` is the
DeepSpeed engine, ``.monitor`` has ``log_metrics(dict, step)``, and ``evaluate(step=None)``
returns ``(loss, accuracy)`` after all-reducing its sums with ``dist.all_reduce`` on the default
group, as the seeds' ``evaluate_multi_dataset`` does. It is the unguarded code a user already
has; the guard is added from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from qwen2_5_vl_synthetic import split_batch

from ncclguard.integrations.deepspeed import EvalSums

__all__ = ["ds_config", "ReferenceTrainer", "ListMonitor"]


def ds_config(stage: int, micro_batch: int, lr: float = 1e-3) -> dict[str, Any]:
    """A DeepSpeed config that trains on CPU: ZeRO ``stage`` (0, 1 or 2), torch's AdamW.

    Raises:
        ValueError: ``stage`` is not 0, 1 or 2 (ZeRO-3 gathers parameters on a captured group,
            which the guard cannot route; see docs/reference/integrations-evaluation.md).
    """
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0, 1 or 2, got {stage!r}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
    }


class ListMonitor:
    """A monitor that keeps what it is told: ``records`` is a list of (step, metrics)."""

    def __init__(self) -> None:
        self.records: list[tuple[int | None, dict[str, Any]]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Appends ``(step, metrics)``."""
        self.records.append((step, dict(metrics)))


class ReferenceTrainer:
    """Trains a classifier with DeepSpeed and evaluates it the way the seeds' trainer does.

    Args:
        model: the classifier (returns ``.loss`` and ``.logits`` given a batch with ``labels``).
        config: the DeepSpeed config (see :func:`ds_config`).
        eval_data: this rank's evaluation samples, one batch dict to be cut by ``eval_batch_size``.
        eval_batch_size: samples per evaluation forward.
        monitor: an object with ``log_metrics(dict, step)``, or None.
        on_eval_batch: called with the batch index before each evaluation forward (a place to
            simulate a slow rank).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: dict[str, Any],
        eval_data: dict[str, torch.Tensor],
        *,
        eval_batch_size: int = 4,
        monitor: Any = None,
        on_eval_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        self.eval_data = eval_data
        self.eval_batch_size = eval_batch_size
        self.monitor = monitor
        self.on_eval_batch = on_eval_batch

    def train_step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on ``batch``; returns the loss."""
        loss = self.model(**batch).loss
        self.model.backward(loss)
        self.model.step()
        return float(loss.item())

    def eval_sums(self) -> EvalSums:
        """This rank's loss sum, correct predictions and sample count over its evaluation data."""
        loss_sum, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for i, batch in enumerate(split_batch(self.eval_data, self.eval_batch_size)):
                if self.on_eval_batch is not None:
                    self.on_eval_batch(i)
                out = self.model(**batch)
                n = batch["labels"].numel()
                loss_sum += float(out.loss) * n
                correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
                count += n
        return EvalSums(loss_sum, correct, count)

    def evaluate(self, step: int | None = None) -> tuple[float, float]:
        """Evaluates on every rank and all-reduces the sums on the default group.

        Returns:
            (mean loss, accuracy) over all ranks' evaluation data.
        """
        self.model.eval()
        self.model.module.eval()
        sums = self.eval_sums()
        totals = torch.tensor([sums.loss_sum, sums.correct, sums.count], dtype=torch.float64)
        dist.all_reduce(totals)  # the default group, as the seeds do
        self.model.train()
        loss, accuracy = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
        if self.monitor is not None:
            self.monitor.log_metrics({"eval/loss": loss, "eval/accuracy": accuracy}, step)
        return loss, accuracy
