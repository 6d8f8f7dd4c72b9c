"""The reference Qwen2.5-VL classifier, slim_outputs, eval_mode and guarded_evaluate in a world of one.

Real transformers Qwen2.5-VL backbone from the tiny config (no download); single process. The
multi-rank behaviour with DeepSpeed is in tests/integrations/test_deepspeed_eval_multirank.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from qwen2_5_vl_synthetic import (
    BOS,
    EOS,
    IMAGE,
    VIDEO,
    VISION_END,
    VISION_START,
    split_batch,
    synthetic_batch,
    text_only,
    tiny_config,
)
from reference_trainer import ListMonitor
from torch import nn
from transformers import Qwen2_5_VLModel
from transformers.modeling_outputs import SequenceClassifierOutput

from ncclguard.evaluation.modes import eval_mode
from ncclguard.integrations.deepspeed import (
    FAILED_METRIC,
    EvalSums,
    guarded_evaluate,
    last_report,
    patch_trainer,
    unpatch_trainer,
)
from ncclguard.integrations.models.qwen2_5_vl import (
    Qwen2_5_VLForClassification,
    is_slimmed,
    slim_outputs,
    unslim_outputs,
)


def make_model(pooling: str = "last", seed: int = 0) -> Qwen2_5_VLForClassification:
    torch.manual_seed(seed)
    return Qwen2_5_VLForClassification(tiny_config(), pooling=pooling).eval()


@pytest.fixture(scope="module")
def batch():
    return synthetic_batch(tiny_config(), 4, seed=1)


# --- the classifier -----------------------------------------------------------------------------


def test_classifier_learns_the_synthetic_task():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = Qwen2_5_VLForClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [synthetic_batch(cfg, 8, seed=s) for s in range(4)]
    losses = []
    for i in range(16):
        out = model(**batches[i % 4])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.5 * first, losses
    held_out = synthetic_batch(cfg, 32, seed=99)
    with torch.no_grad():
        accuracy = (model(**held_out).logits.argmax(-1) == held_out["labels"]).float().mean().item()
    assert accuracy >= 0.6  # chance is 0.25 with 4 labels


def test_output_has_loss_and_logits_only_unless_asked(batch):
    model = make_model()
    with torch.no_grad():
        out = model(**batch)
        assert isinstance(out, SequenceClassifierOutput)
        assert sorted(out.keys()) == ["logits", "loss"]
        assert out.hidden_states is None and out.attentions is None
        assert out.logits.shape == (4, 4)
        assert out.loss.ndim == 0
        asked = model(**batch, output_hidden_states=True)
    seq = batch["input_ids"].shape[1]
    assert len(asked.hidden_states) == 3  # embeddings + 2 layers
    assert all(h.shape == (4, seq, 64) for h in asked.hidden_states)
    assert torch.equal(asked.logits, out.logits)


def test_no_labels_no_loss_and_tuple_output(batch):
    model = make_model()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        out = model(**inputs)
        assert out.loss is None
        tup = model(**batch, return_dict=False)
    assert isinstance(tup, tuple) and len(tup) == 2
    assert torch.equal(tup[1], out.logits)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_pooling_ignores_padding(pooling, side):
    # Unequal lengths: every sample but the longest is padded; each must score as it does alone.
    cfg = tiny_config()
    model = make_model(pooling)
    padded = synthetic_batch(cfg, 4, seed=3, text_len=(3, 12), padding_side=side)
    assert (padded["attention_mask"] == 0).any()
    with torch.no_grad():
        together = model(**padded).logits
        for i, one in enumerate(split_batch(padded, 1)):
            keep = one["attention_mask"][0].bool()
            alone = {**one, "input_ids": one["input_ids"][:, keep], "attention_mask": one["attention_mask"][:, keep]}
            assert torch.allclose(model(**alone).logits, together[i : i + 1], atol=1e-5), (pooling, side, i)


def test_pooling_is_validated_and_saved(tmp_path):
    with pytest.raises(ValueError, match="pooling must be one of"):
        Qwen2_5_VLForClassification(tiny_config(), pooling="max")
    with pytest.raises(TypeError, match="Qwen2_5_VLConfig"):
        Qwen2_5_VLForClassification({"hidden_size": 64})
    model = make_model("mean")
    model.save_pretrained(tmp_path)
    again = Qwen2_5_VLForClassification.from_pretrained(tmp_path)
    assert again.pooling == "mean"
    assert torch.equal(again.score.weight, model.score.weight)


def test_loads_the_backbone_of_a_qwen2_5_vl_checkpoint(tmp_path):
    # What transformers writes for Qwen2_5_VLForConditionalGeneration (the Hub's layout:
    # model.layers.*, visual.*, lm_head) loads into the classifier; the head starts fresh.
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    source = Qwen2_5_VLForConditionalGeneration(tiny_config())
    source.save_pretrained(tmp_path / "generation")
    model = Qwen2_5_VLForClassification.from_pretrained(tmp_path / "generation")
    want = {k: v for k, v in source.state_dict().items() if k.startswith("model.")}
    got = model.state_dict()
    assert len(want) == 56
    assert all(torch.equal(got[k], v) for k, v in want.items())
    model.save_pretrained(tmp_path / "classifier")
    again = Qwen2_5_VLForClassification.from_pretrained(tmp_path / "classifier")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in got.items())


# --- always_run_vision: the same modules on every step, whatever the batch holds ------------------


def twins() -> tuple[Qwen2_5_VLForClassification, Qwen2_5_VLForClassification]:
    """The same weights, with (default) and without the always-run vision pass."""
    fixed = make_model().train()
    stock = Qwen2_5_VLForClassification(tiny_config(), always_run_vision=False).train()
    stock.load_state_dict(fixed.state_dict())
    return fixed, stock


def module_calls(model: nn.Module, inputs: dict) -> list[str]:
    """Names of the modules a forward and backward call, in call order (what ZeRO-3 and FSDP
    gather and reduce for, module by module)."""
    calls: list[str] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: calls.append(name))
        for name, m in model.named_modules()
        if name
    ]
    try:
        model(**inputs).loss.backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return calls


def video_sample(seed: int = 0) -> dict[str, torch.Tensor]:
    """One sample holding an image of 4x4 patches and a video of 2x4x4 patches (4 + 8 tokens)."""
    vc = tiny_config().vision_config
    gen = torch.Generator().manual_seed(seed)
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    ids = [BOS, 70, 71, VISION_START, *[IMAGE] * 4, VISION_END, VISION_START, *[VIDEO] * 8, VISION_END, EOS]
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "pixel_values": torch.randn(16, patch_dim, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "pixel_values_videos": torch.randn(32, patch_dim, generator=gen),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
        "labels": torch.tensor([1]),
    }


def test_a_text_only_batch_gives_exactly_the_stock_outputs_and_gradients(batch):
    fixed, stock = twins()
    text = text_only(batch)
    out_fixed, out_stock = fixed(**text), stock(**text)
    assert torch.equal(out_fixed.logits, out_stock.logits) and torch.equal(out_fixed.loss, out_stock.loss)
    out_fixed.loss.backward()
    out_stock.loss.backward()
    vision = 0
    for (name, p), q in zip(fixed.named_parameters(), stock.parameters(), strict=True):
        if name.startswith("model.visual."):
            vision += 1
            assert q.grad is None  # the stock model never called the tower
            assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))  # called, exactly 0
        else:
            assert torch.equal(p.grad, q.grad), name
    assert vision == len(list(fixed.model.visual.parameters())) == 30  # every one took part


def test_an_image_batch_gives_exactly_the_stock_outputs_and_gradients(batch):
    fixed, stock = twins()
    out_fixed, out_stock = fixed(**batch), stock(**batch)
    assert torch.equal(out_fixed.logits, out_stock.logits)
    out_fixed.loss.backward()
    out_stock.loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(fixed.parameters(), stock.parameters(), strict=True))


def test_images_and_videos_go_through_the_tower_in_one_call_with_the_stock_result():
    fixed, stock = twins()
    sample = video_sample()
    with torch.no_grad():
        assert torch.allclose(fixed(**sample).logits, stock(**sample).logits, atol=1e-6)
    assert module_calls(fixed, sample).count("model.visual") == 1
    assert module_calls(stock, sample).count("model.visual") == 2  # once for images, once for videos


def test_every_batch_calls_the_same_modules_in_the_same_order(batch):
    fixed, stock = twins()
    text = text_only(batch)
    # What makes a mixed batch safe under ZeRO-3 and FSDP: one sequence of module calls for all.
    with_images, text_alone, both = (module_calls(fixed, b) for b in (batch, text, video_sample()))
    assert with_images == text_alone == both
    assert with_images[:2] == ["model.language_model.embed_tokens", "model.visual"]
    # The stock path skips the whole tower for the text-only batch: the desync.
    stock_images, stock_text = module_calls(stock, batch), module_calls(stock, text)
    skipped = [name for name in stock_images if name not in stock_text]
    assert skipped and all(name.startswith("model.visual") for name in skipped)
    assert [n for n in stock_images if not n.startswith("model.visual")] == stock_text


def test_the_zero_cost_pass_runs_in_eval_and_without_grad_too(batch):
    fixed, _ = twins()
    fixed.eval()
    calls = []
    fixed.model.visual.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        fixed(**text_only(batch))  # ZeRO-3 gathers parameters in evaluation as well
    assert calls == [1]


def test_bad_vision_inputs_are_rejected_before_the_tower_runs(batch):
    model = make_model()
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    no_grid = {k: v for k, v in batch.items() if k != "image_grid_thw"}
    with pytest.raises(ValueError, match="without their grid"):
        model(**no_grid)
    too_few = {**batch, "input_ids": text_only(batch)["input_ids"]}
    with pytest.raises(ValueError, match="placeholder tokens do not match the grids: 0 tokens, 16 features"):
        model(**too_few)
    no_ids = {k: v for k, v in batch.items() if k != "input_ids"}
    with pytest.raises(ValueError, match="pass input_ids, or build the model with always_run_vision=False"):
        model(**no_ids, inputs_embeds=torch.zeros(4, batch["input_ids"].shape[1], 64))
    assert calls == []


def test_always_run_vision_is_validated_and_saved(tmp_path):
    with pytest.raises(TypeError, match="always_run_vision must be True or False"):
        Qwen2_5_VLForClassification(tiny_config(), always_run_vision="yes")
    assert make_model().always_run_vision is True
    model = Qwen2_5_VLForClassification(tiny_config(), always_run_vision=False)
    model.save_pretrained(tmp_path)
    assert Qwen2_5_VLForClassification.from_pretrained(tmp_path).always_run_vision is False


# --- slim_outputs ---------------------------------------------------------------------------------


class SeedV1Classifier(nn.Module):
    """A plain module like the seeds' V1: passes the backbone's hidden states on, always."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = Qwen2_5_VLModel(tiny_config())
        self.head = nn.Linear(64, 4)

    def forward(self, input_ids, attention_mask, pixel_values, image_grid_thw, labels=None):
        mm = (input_ids == self.backbone.config.image_token_id).int()
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=mm,
            output_hidden_states=True,
        )
        logits = self.head(out.last_hidden_state[:, -1])
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


def test_slim_outputs_on_a_plain_module(batch):
    model = SeedV1Classifier().eval()
    with torch.no_grad():
        full = model(**batch)
        assert len(full.hidden_states) == 3
        assert slim_outputs(model) is model
        slim = model(**batch)
        assert sorted(slim.keys()) == ["logits", "loss"]
        assert slim.hidden_states is None
        assert torch.equal(slim.logits, full.logits) and torch.equal(slim.loss, full.loss)
        unslim_outputs(model)
        assert len(model(**batch).hidden_states) == 3


def test_slim_outputs_on_a_plain_module_returning_a_dict():
    class DictModel(nn.Module):
        def forward(self, x):
            return {"logits": x * 2, "hidden_states": (x, x), "attentions": (x,), "extra": 1}

    model = slim_outputs(DictModel())
    assert model(torch.ones(2)).keys() == {"logits", "extra"}


def test_slim_outputs_on_an_hf_model_overrides_the_config_default(batch):
    model = make_model()
    model.config.output_hidden_states = True
    seen = []
    model.model.register_forward_hook(lambda m, a, out: seen.append(out.hidden_states))
    with torch.no_grad():
        assert len(model(**batch).hidden_states) == 3
        slim_outputs(model)
        out = model(**batch)
        assert out.hidden_states is None
        assert seen[-1] is None  # the backbone was told not to collect them at all
        # Explicitly asked, by keyword or by position: kept (feature extraction still works).
        assert len(model(**batch, output_hidden_states=True).hidden_states) == 3
        args = [batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "labels")]
        assert len(model(*args, True).hidden_states) == 3
        unslim_outputs(model)
        assert len(model(**batch).hidden_states) == 3


def test_slim_outputs_is_idempotent_and_undoable():
    model = make_model()
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    slim_outputs(model)
    slim_outputs(model)
    assert is_slimmed(model)
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == (hooks[0] + 1, hooks[1] + 1)
    unslim_outputs(model)
    unslim_outputs(model)
    assert not is_slimmed(model)
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks
    with pytest.raises(TypeError, match="torch.nn.Module"):
        slim_outputs(object())


def test_slim_outputs_leaves_tuple_outputs_alone(batch):
    model = slim_outputs(make_model())
    with torch.no_grad():
        assert len(model(**batch, return_dict=False, output_hidden_states=True)) == 3


# --- eval_mode and guarded_evaluate in a world of one ---------------------------------------------


def test_eval_mode_restores_every_flag_exactly():
    model = make_model().train()
    model.model.visual.eval()  # a frozen tower the user keeps in eval mode
    before = {name: m.training for name, m in model.named_modules()}
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert {name: m.training for name, m in model.named_modules()} == before
    with pytest.raises(RuntimeError):
        with eval_mode(model):
            raise RuntimeError("evaluation broke")
    assert {name: m.training for name, m in model.named_modules()} == before


def test_guarded_evaluate_alone_returns_the_result_and_restores_modes():
    model = make_model().train()
    seen = []
    # The deadlines of evaluations that must succeed are hang guards (they cost nothing when the
    # evaluation returns): 5 s was close to a starved thread's 2-4 s on a loaded machine.
    value = guarded_evaluate(model, lambda: seen.append(model.training) or (0.5, 0.75), eval_timeout_s=30)
    assert value == (0.5, 0.75)
    assert seen == [False] and model.training is True
    assert guarded_evaluate(model, lambda: EvalSums(3.0, 2, 4), eval_timeout_s=30) == (0.75, 0.5)
    assert last_report().ok is True


def test_guarded_evaluate_alone_skips_a_stall_and_tells_the_monitor():
    model = make_model()
    monitor = ListMonitor()
    start = time.monotonic()
    value = guarded_evaluate(
        model, lambda: time.sleep(30), eval_timeout_s=0.5, step=7, monitor=monitor, fallback=(-1.0, -1.0)
    )
    # A hang guard: the 0.5 s deadline ended it, not the 30 s sleep (a bound between the two, well
    # above what a loaded machine adds to the deadline).
    assert time.monotonic() - start < 20
    assert value == (-1.0, -1.0)
    assert len(monitor.records) == 1
    step, metrics = monitor.records[0]
    assert step == 7 and metrics[FAILED_METRIC] == 1.0
    assert "ran past its 0.5 s deadline" in metrics["eval/failure_reason"]


def test_guarded_evaluate_alone_retries_after_shrink():
    size = {"batch": 8}

    def evaluate():
        if size["batch"] > 2:
            raise MemoryError(f"batch {size['batch']} does not fit")
        return (1.0, 1.0)

    value = guarded_evaluate(  # a hang guard: only the MemoryErrors may fail an attempt
        make_model(), evaluate, eval_timeout_s=30, retries=2, shrink=lambda: size.update(batch=size["batch"] // 2)
    )
    assert value == (1.0, 1.0)
    report = last_report()
    assert report.attempts == 3 and report.ok
    assert [r.split(":")[1].strip() for r in report.reasons] == ["MemoryError", "MemoryError"]


@pytest.mark.parametrize(
    "kwargs, error, phrase",
    [
        ({"eval_timeout_s": 0}, ValueError, "positive"),
        ({"eval_timeout_s": "soon"}, TypeError, "seconds"),
        ({"eval_timeout_s": 1, "retries": -1}, ValueError, "greater than or equal to 0"),
        ({"eval_timeout_s": 1, "shrink": 3}, ValueError, "callable"),
        ({"eval_timeout_s": 1, "monitor": object()}, ValueError, "log_metrics"),
        ({"eval_timeout_s": 1, "grace": 3}, ValueError, "Extra inputs"),
    ],
)
def test_guarded_evaluate_rejects_bad_options(kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        guarded_evaluate(make_model(), lambda: (0.0, 0.0), **kwargs)


def test_guarded_evaluate_rejects_a_bad_engine_or_eval_fn():
    with pytest.raises(TypeError, match="eval_fn must be callable"):
        guarded_evaluate(make_model(), (0.0, 0.0), eval_timeout_s=1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        guarded_evaluate("engine", lambda: None, eval_timeout_s=1)


class TinyTrainer:
    """The seeds' trainer shape: .model, .monitor, evaluate(step=None) -> (loss, accuracy)."""

    def __init__(self) -> None:
        self.model = make_model()
        self.monitor = ListMonitor()
        self.calls = []

    def evaluate(self, step=None):
        self.calls.append(step)
        return (0.25, 0.5)


def test_patch_trainer_wraps_once_and_unpatches():
    trainer = TinyTrainer()
    # Hang guards: the evaluations must succeed, however slow a loaded machine runs them.
    assert patch_trainer(trainer, eval_timeout_s=30) is trainer
    patch_trainer(trainer, eval_timeout_s=30, retries=1)  # replaces the options, wraps the original once
    assert trainer.evaluate(step=4) == (0.25, 0.5)
    assert trainer.calls == [4]
    assert trainer.last_eval_report.ok is True
    unpatch_trainer(trainer)
    assert "evaluate" not in vars(trainer)
    assert trainer.evaluate(step=5) == (0.25, 0.5)


def test_patch_trainer_uses_the_trainers_monitor():
    trainer = TinyTrainer()
    trainer.evaluate = lambda step=None: time.sleep(30)
    patch_trainer(trainer, eval_timeout_s=0.3)
    assert trainer.evaluate(step=9) == (0.0, 0.0)
    assert trainer.monitor.records[0][0] == 9
    assert trainer.monitor.records[0][1][FAILED_METRIC] == 1.0


def test_patch_trainer_rejects_what_it_cannot_guard():
    class NoModel:
        def evaluate(self, step=None):
            return (0.0, 0.0)

    with pytest.raises(TypeError, match="model must be"):
        patch_trainer(NoModel(), eval_timeout_s=1)
    with pytest.raises(TypeError, match="no evaluate"):
        patch_trainer(object(), eval_timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s"):
        patch_trainer(TinyTrainer(), eval_timeout_s=-1)


def test_guarded_evaluate_outside_the_main_thread_runs_without_sigalrm():
    import threading

    got = []
    model = make_model()
    # A hang guard: the evaluation must succeed (the thread's join waits longer still).
    worker = threading.Thread(target=lambda: got.append(guarded_evaluate(model, lambda: (2.0, 0.5), eval_timeout_s=30)))
    worker.start()
    worker.join(60)
    assert got == [(2.0, 0.5)]
