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

Mixed text and image batches: every forward runs the vision tower exactly once, whatever the
batch holds (``always_run_vision=True``, the default). A batch without pixels takes a dummy
1-image pass whose features are multiplied by 0 and added to the text embeddings, so the outputs
and gradients are those of the text alone while every rank calls the same modules in the same
order (embeddings, vision tower, text stack) on every step. Without that, a rank whose batch has
no image skips the tower: under ZeRO-3 (per-module parameter all_gathers) or FSDP (per-unit
all_gathers and reduce-scatters) its collectives no longer match the other ranks' and the job
hangs (hiyouga/LLaMA-Factory#5616, QwenLM/Qwen3-VL#1832).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPreTrainedModel

# Relative: this folder installs as ncclguard.integrations, and type checkers read it as `integrations`.
from ..slim import is_slimmed, slim_outputs, unslim_outputs

__all__ = ["POOLINGS", "Qwen2_5_VLForClassification", "slim_outputs", "unslim_outputs", "is_slimmed"]

POOLINGS = ("last", "mean")

# transformers 5 builds the 3-D rotary positions from mm_token_type_ids; 4.x derives them itself.
_TAKES_MM_TOKEN_TYPES = "mm_token_type_ids" in inspect.signature(Qwen2_5_VLModel.forward).parameters
# The smallest input the vision tower takes: one frame of spatial_merge_size x spatial_merge_size
# patches, which its merger turns into one feature vector.
_DUMMY_FRAMES = 1
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
        always_run_vision: run the vision tower once on every forward, a zero-cost dummy image
            when the batch has none (default True; see the module doc). False calls the tower
            only for batches with pixels, as transformers' models do: mixed batches can then
            hang ZeRO-3 and FSDP. Stored in the config as ``classifier_always_run_vision``.

    Raises:
        TypeError: ``config`` is not a ``Qwen2_5_VLConfig``, or ``always_run_vision`` is not a bool.
        ValueError: an unknown pooling, or ``config.num_labels`` is not a positive int.
    """

    _checkpoint_conversion_mapping = _LEGACY_KEYS  # read by transformers 4.x only

    def __init__(
        self, config: Qwen2_5_VLConfig, pooling: str | None = None, always_run_vision: bool | None = None
    ) -> None:
        if not isinstance(config, Qwen2_5_VLConfig):
            raise TypeError(f"config must be a transformers.Qwen2_5_VLConfig, got {type(config).__name__}")
        pooling = pooling if pooling is not None else getattr(config, "classifier_pooling", "last")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if always_run_vision is None:
            always_run_vision = getattr(config, "classifier_always_run_vision", True)
        if not isinstance(always_run_vision, bool):
            raise TypeError(f"always_run_vision must be True or False, got {always_run_vision!r}")
        config.classifier_pooling = pooling
        config.classifier_always_run_vision = always_run_vision
        super().__init__(config)
        num_labels = config.num_labels
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"config.num_labels must be a positive int, got {num_labels!r}")
        self.num_labels = num_labels
        self.model = Qwen2_5_VLModel(config)
        hidden_size: int = config.get_text_config().hidden_size
        self.score = nn.Linear(hidden_size, num_labels)
        self.post_init()

    @property
    def pooling(self) -> str:
        """``"last"`` or ``"mean"``."""
        return self.config.classifier_pooling

    @property
    def always_run_vision(self) -> bool:
        """Whether every forward runs the vision tower (a dummy image when the batch has none)."""
        return bool(self.config.classifier_always_run_vision)

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

        Raises:
            ValueError: (``always_run_vision``, before the vision tower runs) pixels without
                their grid or without ``input_ids``, or placeholder tokens that do not match the
                grids.
        """
        want_hidden = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        want_attn = output_attentions if output_attentions is not None else self.config.output_attentions
        self._add_mm_token_types(kwargs, input_ids, image_grid_thw)
        if self.always_run_vision and kwargs.get("mm_encoder_outputs") is None:
            # The tower runs here, once, between the token embeddings and the text stack: the
            # backbone's own order. It gets the merged embeddings and no pixels.
            kwargs["inputs_embeds"] = self._embed_with_vision(
                input_ids,
                kwargs.get("inputs_embeds"),
                (pixel_values, image_grid_thw),
                (kwargs.pop("pixel_values_videos", None), kwargs.get("video_grid_thw")),
            )
            pixel_values = None
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
        result = SequenceClassifierOutput(
            loss=self._loss(logits, labels),
            logits=logits,
            hidden_states=out.hidden_states,  # None unless asked: the backbone collects only then
            attentions=out.attentions,
        )
        return result if return_dict is not False else result.to_tuple()

    def _add_mm_token_types(
        self, kwargs: dict[str, Any], input_ids: torch.Tensor | None, image_grid_thw: torch.Tensor | None
    ) -> None:
        """Puts ``mm_token_type_ids`` (1 on image placeholders, 2 on video ones) in the backbone's
        ``kwargs`` where transformers needs them and the caller gave none."""
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

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
        """The mean cross-entropy of ``logits`` against ``labels`` (computed in float32), or None
        without labels."""
        if labels is None:
            return None
        targets = labels.view(-1).to(logits.device)
        return nn.functional.cross_entropy(logits.float().view(-1, self.num_labels), targets)

    def _embed_with_vision(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        images: tuple[torch.Tensor | None, torch.Tensor | None],
        videos: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> torch.Tensor:
        """Token embeddings with the vision features in place, from exactly one vision-tower call.

        Images and videos go through the tower together (it keeps each item apart by its grid);
        a batch with neither sends a dummy image whose features are multiplied by 0.
        """
        visual = self.model.visual
        merge = visual.spatial_merge_size**2
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        places: list[tuple[torch.Tensor, int]] = []  # (placeholder mask, features) per kind
        for kind, token, (values, grid) in (
            ("image", self.config.image_token_id, images),
            ("video", self.config.video_token_id, videos),
        ):
            if values is None:
                continue
            if grid is None:
                raise ValueError(f"{kind} pixels were given without their grid (image_grid_thw / video_grid_thw)")
            if input_ids is None:
                raise ValueError(
                    f"always_run_vision places {kind} features at their placeholder tokens in input_ids; pass "
                    "input_ids, or build the model with always_run_vision=False"
                )
            features = int(grid.prod(-1).sum()) // merge
            mask = input_ids.eq(token)
            placeholders = int(mask.sum())
            if placeholders != features:
                raise ValueError(
                    f"{kind} placeholder tokens do not match the grids: {placeholders} tokens, {features} features"
                )
            pixels.append(values)
            grids.append(grid)
            places.append((mask, features))
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
        if not pixels:
            dummy, grid = self._dummy_image(inputs_embeds.device)
            zero = _vision_features(visual(dummy, grid_thw=grid)).mul(0).sum()
            # x + 0 is x, bit for bit, and d(x + 0 * f)/dx is 1: the text's outputs and
            # gradients are unchanged; every vision parameter gets an exact zero gradient.
            return inputs_embeds + zero.to(inputs_embeds.dtype)
        features = _vision_features(visual(torch.cat(pixels).type(visual.dtype), grid_thw=torch.cat(grids)))
        features = features.to(inputs_embeds.device, inputs_embeds.dtype)
        start = 0
        for mask, n in places:
            inputs_embeds = inputs_embeds.masked_scatter(
                mask.unsqueeze(-1).to(inputs_embeds.device), features[start : start + n]
            )
            start += n
        return inputs_embeds

    def _dummy_image(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest input of the vision tower (one feature vector out): zero pixels and its grid."""
        vc: Any = self.config.vision_config  # typed as a union of dict and config; a config here
        side = vc.spatial_merge_size
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size
        pixels = torch.zeros((_DUMMY_FRAMES * side * side, patch_dim), dtype=self.model.visual.dtype, device=device)
        grid = torch.tensor([[_DUMMY_FRAMES, side, side]], dtype=torch.long, device=device)
        return pixels, grid

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


def _vision_features(out: Any) -> torch.Tensor:
    """The merged features of a vision-tower call: ``pooler_output`` (transformers 5) or the tensor (4.x)."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


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
