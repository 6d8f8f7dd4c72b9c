"""A reference Qwen2.5-VL sequence classifier whose outputs stay small, and slim_outputs for any model.

transformers has no Qwen2.5-VL sequence classifier, so users write their own (the seeds'
``models/qwen2_5_vl_classify.py``). This one is that model done carefully: transformers' real
Qwen2.5-VL backbone, one pooled vector per sample (the last non-padding token, or the mean over
non-padding tokens), a linear head and cross-entropy. It returns ``hidden_states`` and
``attentions`` only when asked (``output_hidden_states=True`` in the call or the config), so
feature extraction keeps working and nothing large is kept by default.

Loading pretrained weights: the backbone lives at ``.model`` like in
``Qwen2_5_VLForConditionalGeneration``, so ``Qwen2_5_VLForClassification.from_pretrained(
"Qwen/Qwen2.5-VL-7B-Instruct", num_labels=N)`` takes the backbone's weights and initialises the
head (the checkpoint's ``lm_head`` is left out).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPreTrainedModel

from ncclguard.integrations.slim import is_slimmed, slim_outputs, unslim_outputs

__all__ = ["POOLINGS", "Qwen2_5_VLForClassification", "slim_outputs", "unslim_outputs", "is_slimmed"]

POOLINGS = ("last", "mean")

# transformers 5 builds the 3-D rotary positions from mm_token_type_ids; 4.x derives them itself.
_TAKES_MM_TOKEN_TYPES = "mm_token_type_ids" in inspect.signature(Qwen2_5_VLModel.forward).parameters
# Checkpoint key layout: Qwen2.5-VL checkpoints (the Hub's, and what transformers 5 writes) keep
# the text stack at model.* and the vision tower at visual.*; the backbone here has them at
# model.language_model.* and model.visual.*, as in Qwen2_5_VLForConditionalGeneration, so the
# same renaming applies (loading, and reversed when saving).
_LEGACY_KEYS = {r"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"}


class Qwen2_5_VLForClassification(Qwen2_5_VLPreTrainedModel):
    """Qwen2.5-VL backbone, pooling, a linear head; cross-entropy over ``config.num_labels`` classes.

    Args:
        config: a ``Qwen2_5_VLConfig``; ``num_labels`` sets the classes.
        pooling: ``"last"`` (the last non-padding token, which in a causal model has seen the whole
            sample; the default) or ``"mean"`` (the mean over non-padding tokens). Stored in the
            config as ``classifier_pooling`` so a saved model reloads with it.

    Raises:
        TypeError: ``config`` is not a ``Qwen2_5_VLConfig``.
        ValueError: an unknown pooling.
    """

    _checkpoint_conversion_mapping = _LEGACY_KEYS  # read by transformers 4.x only

    def __init__(self, config: Qwen2_5_VLConfig, pooling: str | None = None) -> None:
        if not isinstance(config, Qwen2_5_VLConfig):
            raise TypeError(f"config must be a transformers.Qwen2_5_VLConfig, got {type(config).__name__}")
        pooling = pooling if pooling is not None else getattr(config, "classifier_pooling", "last")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        config.classifier_pooling = pooling
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = Qwen2_5_VLModel(config)
        self.score = nn.Linear(config.text_config.hidden_size, config.num_labels)
        self.post_init()

    @property
    def pooling(self) -> str:
        """``"last"`` or ``"mean"``."""
        return self.config.classifier_pooling

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput | tuple:
        """Classifies each sample of the batch.

        Args:
            input_ids: (batch, sequence) token ids, with ``config.image_token_id`` placeholders
                where the image's features go.
            attention_mask: (batch, sequence), 1 on real tokens, 0 on padding (either side).
            pixel_values: (patches, channels x temporal_patch x patch x patch), as the
                Qwen2.5-VL processor makes them.
            image_grid_thw: (images, 3) patches per image in time, height, width.
            labels: (batch,) class indices; when given, ``loss`` is the mean cross-entropy.
            output_hidden_states: return the backbone's hidden states (layers + 1 tensors).
                Default: ``config.output_hidden_states``.
            output_attentions: return the attention maps (needs ``attn_implementation="eager"``).
                Default: ``config.output_attentions``.
            return_dict: False returns a tuple of the non-None fields. Default: True.
            **kwargs: passed to the backbone (``pixel_values_videos``, ``video_grid_thw``,
                ``position_ids``, ``inputs_embeds``, ``mm_token_type_ids``, ...).

        Returns:
            ``SequenceClassifierOutput`` with ``loss`` (None without labels) and ``logits``
            (batch, num_labels); ``hidden_states`` and ``attentions`` are None unless asked.
        """
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        want_attn = output_attentions if output_attentions is not None else self.config.output_attentions
        if (
            _TAKES_MM_TOKEN_TYPES
            and kwargs.get("mm_token_type_ids") is None
            and input_ids is not None
            and (image_grid_thw is not None or kwargs.get("video_grid_thw") is not None)
        ):
            # transformers 5 builds Qwen2.5-VL's 3-D rotary positions from these; the processor
            # makes them, a hand-built batch usually lacks them.
            kwargs["mm_token_type_ids"] = (input_ids == self.config.image_token_id).int() + 2 * (
                input_ids == self.config.video_token_id
            ).int()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            output_hidden_states=want_hidden if want_hidden is not None else False,
            output_attentions=bool(want_attn),
            use_cache=False,
            return_dict=True,
            **kwargs,
        )
        pooled = self._pool(out.last_hidden_state, attention_mask, input_ids)
        logits = self.score(pooled)
        loss = None
        if labels is not None:
            targets = labels.view(-1).to(logits.device)
            loss = nn.functional.cross_entropy(logits.float().view(-1, self.num_labels), targets)
        result = SequenceClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=out.hidden_states,  # None unless asked: the backbone collects only then
            attentions=out.attentions,
        )
        return result if return_dict is not False else result.to_tuple()

    def _pool(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, input_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """One vector per sample from (batch, sequence, hidden)."""
        if attention_mask is not None:
            mask = attention_mask.to(hidden.device).bool()
        elif input_ids is not None and self.config.pad_token_id is not None:
            mask = (input_ids != self.config.pad_token_id).to(hidden.device)
        else:
            mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        if self.pooling == "mean":
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        # The highest position holding a real token: right and left padding alike.
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        last = (positions * mask).argmax(-1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def _register_checkpoint_layout() -> None:
    """transformers 5: map checkpoint keys like Qwen2_5_VLForConditionalGeneration does."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # transformers 4.x reads the class attribute instead
        return
    mapping = get_checkpoint_conversion_mapping("Qwen2_5_VLForConditionalGeneration")
    if mapping is not None:
        register_checkpoint_conversion_mapping(Qwen2_5_VLForClassification.__name__, mapping, overwrite=True)


_register_checkpoint_layout()
