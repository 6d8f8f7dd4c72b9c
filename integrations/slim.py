"""slim_outputs: make a model's forward return only what its caller asked for.

A forward that returns ``hidden_states`` keeps (layers + 1) tensors of batch x sequence x hidden
alive for as long as the caller holds the output; for Qwen2.5-VL-7B at batch 8 and sequence 2048
that is 29 x 235 MB. HF models collect them when ``output_hidden_states`` is passed or set in
the config; a hand-written classifier may pass them on unconditionally (the seeds' V1 did).

:func:`slim_outputs` patches one model instance with two forward hooks (so nothing about the
class changes and :func:`unslim_outputs` removes them exactly):

- before the forward, when the forward takes ``output_hidden_states`` / ``output_attentions``
  and the call did not set them, they are passed as ``False``, so an HF backbone does not even
  collect the tensors (a config default of True is overridden);
- after the forward, the fields the call did not explicitly ask for are dropped from the
  returned ``ModelOutput`` (or dict): :data:`SLIMMED_FIELDS`. ``loss``, ``logits`` and
  everything else stay, including ``past_key_values``, which ``generate()`` needs.

A tuple output (``return_dict=False``) is returned as it is: its positions carry no names.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["SLIMMED_FIELDS", "slim_outputs", "unslim_outputs", "is_slimmed", "innermost_module"]

# Output field -> the forward argument that asks for it.
SLIMMED_FIELDS: dict[str, str] = {
    "hidden_states": "output_hidden_states",
    "encoder_hidden_states": "output_hidden_states",
    "decoder_hidden_states": "output_hidden_states",
    "vision_hidden_states": "output_hidden_states",
    "image_hidden_states": "output_hidden_states",
    "attentions": "output_attentions",
    "encoder_attentions": "output_attentions",
    "decoder_attentions": "output_attentions",
    "cross_attentions": "output_attentions",
}
_FLAGS = sorted(set(SLIMMED_FIELDS.values()))
_HANDLES = "_ncclguard_slim_handles"


def innermost_module(model: Any) -> nn.Module:
    """Unwraps a DeepSpeed engine, DistributedDataParallel or DataParallel to the model it runs.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"expected a torch.nn.Module (a model, an HF PreTrainedModel or a DeepSpeed engine), got "
            f"{type(model).__name__}"
        )
    wrappers: list[type[nn.Module]] = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    deepspeed = sys.modules.get("deepspeed")  # an engine exists only if deepspeed was imported
    if deepspeed is not None and hasattr(deepspeed, "DeepSpeedEngine"):
        wrappers.append(deepspeed.DeepSpeedEngine)
    kinds: tuple[type[nn.Module], ...] = tuple(wrappers)
    inner: nn.Module = model
    while isinstance(inner, kinds):
        inner = inner.get_submodule("module")  # each wrapper keeps the model it runs as .module
    return inner


def _explicit(signature: inspect.Signature | None, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The flag arguments this call set itself, by name, positional ones included."""
    found = {k: kwargs[k] for k in _FLAGS if k in kwargs}
    if signature is not None and args:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # the forward itself will report the bad call
            return found
        found.update({k: bound[k] for k in _FLAGS if k in bound})
    return found


def _accepted_flags(module: nn.Module, signature: inspect.Signature | None) -> set[str]:
    """The flags the forward takes: named parameters, or ``**kwargs`` of an HF model (TransformersKwargs)."""
    if signature is None:
        return set()
    named = {k for k in _FLAGS if k in signature.parameters}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    transformers = sys.modules.get("transformers")
    if takes_any and transformers is not None and isinstance(module, transformers.PreTrainedModel):
        return set(_FLAGS)
    return named


def _asked(value: Any) -> bool:
    # transformers 5 also accepts layer indices for output_hidden_states: any non-False value asks.
    return value is not None and value is not False


def slim_outputs(model: nn.Module) -> nn.Module:
    """Patches ``model`` so its forward drops the large optional outputs the call did not ask for.

    Idempotent: a second call changes nothing. On a DeepSpeed engine (or DDP) the wrapped model is
    patched, so ``engine(...)`` and ``engine.module(...)`` are both slim.

    Args:
        model: a ``torch.nn.Module``, an HF ``PreTrainedModel`` or a DeepSpeed engine.

    Returns:
        ``model`` itself, for chaining.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    inner = innermost_module(model)
    if getattr(inner, _HANDLES, None):
        return model
    try:
        signature: inspect.Signature | None = inspect.signature(inner.forward)
    except (TypeError, ValueError):
        signature = None
    accepted = _accepted_flags(inner, signature)

    def before(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        for flag in accepted - set(_explicit(signature, args, kwargs)):
            kwargs[flag] = False
        return args, kwargs

    # The post-hook sees the kwargs as rewritten above: a flag is True there only when the caller
    # asked for it, so the call's own request decides what stays.
    def after(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        explicit = _explicit(signature, args, kwargs)
        return _drop(output, {f for f, flag in SLIMMED_FIELDS.items() if not _asked(explicit.get(flag))})

    handles = [
        inner.register_forward_pre_hook(before, with_kwargs=True),
        inner.register_forward_hook(after, with_kwargs=True),
    ]
    setattr(inner, _HANDLES, handles)
    return model


def unslim_outputs(model: nn.Module) -> nn.Module:
    """Undoes :func:`slim_outputs`; a model that is not slimmed is returned unchanged.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    inner = innermost_module(model)
    for handle in inner.__dict__.pop(_HANDLES, None) or []:
        handle.remove()
    return model


def is_slimmed(model: nn.Module) -> bool:
    """Whether :func:`slim_outputs` is in force on ``model`` (or the model a wrapper runs)."""
    return bool(getattr(innermost_module(model), _HANDLES, None))


def _drop(output: Any, fields: set[str]) -> Any:
    """Returns ``output`` without ``fields``; a ModelOutput is rebuilt (its keys cannot be deleted)."""
    if isinstance(output, Mapping):
        present = [k for k in output.keys() if k in fields]
        if not present:
            return output
        kept = {k: v for k, v in output.items() if k not in fields}
        if type(output) is dict:
            return kept
        try:  # a ModelOutput dataclass: unset fields default to None
            return type(output)(**kept)
        except TypeError:
            return output
    return output
