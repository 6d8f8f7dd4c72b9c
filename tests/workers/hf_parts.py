"""The HF tests' tiny model, data and arguments, with nothing of ncclguard imported: a worker that
makes its process group before it imports ncclguard (as a user's script does) takes them from here."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

__all__ = ["Dataset", "cpu_arguments", "tiny_bert"]


def tiny_bert() -> BertForSequenceClassification:
    """The HF tests' model: a one-layer BERT classifier built from a config (no download)."""
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
    )
    return BertForSequenceClassification(config)


def cpu_arguments(output_dir: str, max_steps: int) -> TrainingArguments:
    """``TrainingArguments`` as a user leaves them, on the CPU with gloo: nothing saved, no reports."""
    return TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )


class Dataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 100, (n, 16), generator=gen)
        self.y = (self.x[:, 0] > 50).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}
