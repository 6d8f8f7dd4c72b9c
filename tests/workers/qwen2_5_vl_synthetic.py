"""Qwen2.5-VL configs that build without downloads, and a learnable synthetic image+text task.

Used by the tests, the example under docs/examples/ and benchmarks/investigations/slim_outputs_memory.py. The
configs keep every token id inside the (small) vocabulary, which the stock config does not.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2_5_VLConfig

__all__ = [
    "PAD",
    "BOS",
    "EOS",
    "VISION_START",
    "VISION_END",
    "IMAGE",
    "VIDEO",
    "FIRST_CLASS_TOKEN",
    "tiny_config",
    "mid_config",
    "synthetic_batch",
    "split_batch",
    "image_tokens",
    "text_only",
]

# Token ids of the synthetic vocabulary: specials first, then one "class word" per label, then filler.
PAD, BOS, EOS, VISION_START, VISION_END, IMAGE, VIDEO = 0, 1, 2, 3, 4, 5, 6
FIRST_CLASS_TOKEN = 10
_FIRST_FILLER = 64


def _config(text: dict[str, Any], vision: dict[str, Any], num_labels: int) -> Qwen2_5_VLConfig:
    most = _FIRST_FILLER - FIRST_CLASS_TOKEN  # one class word per label below the filler tokens
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or not 2 <= num_labels <= most:
        raise ValueError(f"num_labels must be an int in [2, {most}], got {num_labels!r}")
    specials = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    rope = {"type": "mrope", "mrope_section": text.pop("mrope_section")}
    return Qwen2_5_VLConfig(
        num_labels=num_labels,
        pad_token_id=PAD,
        text_config={**text, **specials, "rope_scaling": rope},
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def tiny_config(num_labels: int = 4) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL of about 0.2 M parameters: 2 text layers of width 64, a 2-block vision tower.

    Args:
        num_labels: classes of the classification head.

    Returns:
        The config (builds in milliseconds, no download).

    Raises:
        ValueError: ``num_labels`` is not an int in [2, 54].
    """
    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        mrope_section=[2, 3, 3],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[1],
    )
    return _config(text, vision, num_labels)


def mid_config(num_labels: int = 4) -> Qwen2_5_VLConfig:
    """A mid-size Qwen2.5-VL that fits a 24 GiB CPU machine: the text stack of Qwen2.5-0.5B.

    Text: 24 layers of width 896 (14 heads, 2 KV heads, MLP 4864), vocabulary cut to 32 000 (the
    vocabulary does not change the size of hidden states). Vision: 4 blocks of width 256.
    About 0.4 G parameters (1.6 GB in float32).

    Raises:
        ValueError: ``num_labels`` is not an int in [2, 54].
    """
    text = dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=32000,
        mrope_section=[8, 12, 12],
    )
    vision = dict(
        depth=4,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        out_hidden_size=896,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[1, 3],
    )
    return _config(text, vision, num_labels)


def image_tokens(config: Qwen2_5_VLConfig, grid_thw: tuple[int, int, int]) -> int:
    """Placeholder tokens one image of ``grid_thw`` patches takes in the text (after the 2x2 merge)."""
    t, h, w = grid_thw
    merge = config.vision_config.spatial_merge_size
    return t * h * w // (merge * merge)


def synthetic_batch(
    config: Qwen2_5_VLConfig,
    batch_size: int,
    *,
    seed: int = 0,
    text_len: tuple[int, int] = (6, 12),
    grid_thw: tuple[int, int, int] = (1, 4, 4),
    padding_side: str = "right",
) -> dict[str, torch.Tensor]:
    """A batch of one image and a text per sample, with a label both carry.

    Each sample reads ``BOS, filler..., class word, filler..., VISION_START, IMAGE x n, VISION_END,
    EOS`` padded with PAD to the longest sample; the class word is ``FIRST_CLASS_TOKEN + label``
    and the image's pixels are shifted by the label, so the task is learnable from either.

    Args:
        config: the model's config (token ids, patch sizes, number of labels).
        batch_size: samples.
        seed: the same seed gives the same batch.
        text_len: (min, max) filler tokens per sample; unequal bounds give unequal lengths.
        grid_thw: the image's (temporal, height, width) in patches; height and width even.
        padding_side: ``"right"`` or ``"left"``.

    Returns:
        ``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``, ``labels``.

    Raises:
        ValueError: a bad size, range, grid or padding side.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    lo, hi = text_len
    if not 1 <= lo <= hi:
        raise ValueError(f"text_len must be (min, max) with 1 <= min <= max, got {text_len!r}")
    merge = config.vision_config.spatial_merge_size
    t, h, w = grid_thw
    if t < 1 or h < merge or w < merge or h % merge or w % merge:
        raise ValueError(f"grid_thw must be (t >= 1, h, w) with h and w multiples of {merge}, got {grid_thw!r}")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")

    gen = torch.Generator().manual_seed(seed)
    vc = config.vision_config
    vocab = config.text_config.vocab_size
    labels = torch.randint(0, config.num_labels, (batch_size,), generator=gen)
    n_image = image_tokens(config, grid_thw)
    rows = []
    for label in labels.tolist():
        n = int(torch.randint(lo, hi + 1, (), generator=gen))
        text = torch.randint(_FIRST_FILLER, vocab, (n,), generator=gen)
        text[int(torch.randint(0, n, (), generator=gen))] = FIRST_CLASS_TOKEN + label
        image = torch.full((n_image,), IMAGE)
        rows.append(
            torch.cat([torch.tensor([BOS]), text, torch.tensor([VISION_START]), image, torch.tensor([VISION_END, EOS])])
        )
    longest = max(len(r) for r in rows)
    input_ids = torch.full((batch_size, longest), PAD)
    attention_mask = torch.zeros((batch_size, longest), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if padding_side == "right" else slice(longest - len(row), longest)
        input_ids[i, span] = row
        attention_mask[i, span] = 1
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size
    patches = t * h * w
    pixel_values = torch.randn((batch_size * patches, patch_dim), generator=gen)
    pixel_values += labels.repeat_interleave(patches).unsqueeze(1).float()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([list(grid_thw)] * batch_size),
        "labels": labels,
    }


def split_batch(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Cuts a batch from :func:`synthetic_batch` into batches of at most ``size`` samples.

    Raises:
        ValueError: ``size`` is not a positive int, or the images differ in size.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    grids = batch["image_grid_thw"]
    if not bool((grids == grids[0]).all()):
        raise ValueError("split_batch needs images of one size (one image_grid_thw for all samples)")
    n = batch["input_ids"].shape[0]
    per_sample = int(grids[0].prod())
    return [
        {
            "input_ids": batch["input_ids"][a : a + size],
            "attention_mask": batch["attention_mask"][a : a + size],
            "pixel_values": batch["pixel_values"][a * per_sample : (a + size) * per_sample],
            "image_grid_thw": grids[a : a + size],
            "labels": batch["labels"][a : a + size],
        }
        for a in range(0, n, size)
    ]


def text_only(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same samples without their images: each image placeholder becomes a filler token, no
    pixels, no grid (a text-only batch of the same shape, as a mixed dataset would give)."""
    ids = batch["input_ids"].clone()
    ids[ids == IMAGE] = _FIRST_FILLER
    return {"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
