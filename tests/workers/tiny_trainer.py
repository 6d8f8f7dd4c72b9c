"""A tiny HF Trainer (a one-layer BERT from a config, on CPU) for the tests that need a real one
in process: the Trainer's own tests, its recovery and its preemption."""

from __future__ import annotations

from pathlib import Path


def tiny_trainer(tmp_path: Path, callbacks=(), **overrides):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.x = torch.randint(0, 100, (n, 8), generator=torch.Generator().manual_seed(n))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": int(self.x[i, 0] > 50)}

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
    )
    args = TrainingArguments(**{**settings, **overrides})
    return Trainer(
        model=BertForSequenceClassification(config),
        args=args,
        train_dataset=Data(32),
        eval_dataset=Data(8),
        callbacks=list(callbacks),
    )
