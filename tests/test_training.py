"""The training module and train(): frozen tensors, loss, KD, agreement, resume (tiny CosyVoice 2 format)."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from ssd.decoding.sampling import SamplingConfig
from ssd.drafters.base import model_outputs
from ssd.drafters.layers import build_draft, load_draft
from ssd.models.cosyvoice2 import CosyVoice2LM
from ssd.training.data import TokenShardDataModule, pad_collate
from ssd.training.module import SpeechLMTrainingModule
from ssd.training.schema import OptimConfig, register_schema, validate_train_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def compose_train_config(world: dict[str, Path], output_dir: Path, *overrides: str):
    """train_draft.yaml composed as the CLI would, pointed at the micro world."""
    register_schema()
    base = [
        f"target.model.model_dir={world['target']}",
        f"data.shard_dirs={world['shards']}",
        "data.max_tokens=200",
        f"output_dir={output_dir}",
        "logger=csv",
    ]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("train_draft", overrides=base + list(overrides))


def _datamodule(world) -> TokenShardDataModule:
    return TokenShardDataModule(world["shards"], max_tokens=200, dev_subsets=["dev-clean"])


def _fit(module, world, steps: int, callbacks=()) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(module, datamodule=_datamodule(world))
    return trainer


def _draft(target, layers=(0, 1, -1), trainable=("layers.0", "head")):
    return build_draft(target, layers, trainable)


def _all_batches(world, split="train"):
    dm = _datamodule(world)
    dm.setup()
    data = dm.train_set if split == "train" else dm.dev_set
    return [pad_collate([data[i] for i in range(j, min(j + 8, len(data)))]) for j in range(0, len(data), 8)]


class _ModeProbe(L.Callback):
    def __init__(self):
        self.modes = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        layers = module.model.model.backbone.layers
        self.modes.append((layers[0].training, layers[1].training, module.model.model.speech_embedding.training,
                           module.model.model.llm_decoder.training, module.teacher.training))  # fmt: skip


def test_only_trainable_tensors_change_and_frozen_modules_stay_in_eval(training_world):
    target = CosyVoice2LM.from_dir(training_world["target"])
    draft = _draft(target)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    draft_before = {k: v.clone() for k, v in draft.named_parameters()}
    module = SpeechLMTrainingModule(draft, target, optim=OptimConfig(lr=1e-2, warmup_steps=0), max_steps=4,
                                    kd_weight=0.5)  # fmt: skip
    probe = _ModeProbe()
    _fit(module, training_world, steps=4, callbacks=[probe])

    changed = {k for k, p in draft.named_parameters() if not torch.equal(p, draft_before[k])}
    trainable = {k for k, p in draft.named_parameters() if p.requires_grad}
    assert trainable and changed == trainable  # every trained tensor moved, nothing else did
    for key, value in target.state_dict().items():
        assert torch.equal(value, target_before[key]), f"target tensor {key} changed"
    assert all(m == (True, False, False, True, False) for m in probe.modes) and len(probe.modes) == 4


def test_training_lowers_the_loss_on_micro_data(training_world):
    target = CosyVoice2LM.from_dir(training_world["target"])
    module = SpeechLMTrainingModule(target, outputs=partial(model_outputs, target),
                                    optim=OptimConfig(lr=3e-3, warmup_steps=5), max_steps=60)  # fmt: skip
    batches = _all_batches(training_world)

    def mean_ce():
        with torch.no_grad():
            return float(np.mean([module.compute(b, with_teacher=False)["ce"].item() for b in batches]))

    before = mean_ce()
    _fit(module, training_world, steps=60)
    after = mean_ce()
    assert after < before - 0.5, (before, after)


def test_kd_is_zero_and_agreement_perfect_when_draft_equals_target(training_world):
    target = CosyVoice2LM.from_dir(training_world["target"])
    sampling = SamplingConfig(top_k=25, top_p=0.8, nucleus="cosyvoice", ras_window=10,
                              stop_tokens=(61, 62, 63), eos_mode="resample")  # fmt: skip
    same = _draft(target, layers=range(4), trainable=("head",))
    module = SpeechLMTrainingModule(same, target, kd_weight=0.5, agreement_sampling=sampling)
    batch = _all_batches(training_world, "dev")[0]
    out = module.compute(batch, with_teacher=True)
    assert out["kl"].abs().item() < 1e-6
    agree = module.agreement(out["logits"], out["teacher_logits"], out["scored"], batch)
    assert agree["alpha_softmax"].item() == pytest.approx(1.0, abs=1e-5)
    assert agree["alpha_target_sampling"].item() == pytest.approx(1.0, abs=1e-5)
    assert agree["top1_agreement"].item() == 1.0

    shallow = SpeechLMTrainingModule(_draft(target), target, kd_weight=0.5, agreement_sampling=sampling)
    out = shallow.compute(batch, with_teacher=True)
    reference = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=out["teacher_logits"]),
        torch.distributions.Categorical(logits=out["logits"]),
    ).mean()
    assert out["kl"].item() == pytest.approx(reference.item(), rel=1e-4) and out["kl"].item() > 1e-3
    assert out["loss"].item() == pytest.approx(0.5 * out["ce"].item() + 0.5 * out["kl"].item(), rel=1e-5)
    alpha = shallow.agreement(out["logits"], out["teacher_logits"], out["scored"], batch)[
        "alpha_softmax"
    ].item()
    assert 0.0 < alpha < 0.999


def test_sampling_context_gives_each_position_its_teacher_forced_window():
    batch = {
        "speech_tokens": torch.tensor([[5, 6, 7], [8, 0, 0]]),
        "speech_lens": torch.tensor([3, 1]),
        "text_lens": torch.tensor([2, 4]),
    }
    rows, scored_steps = torch.tensor([0, 0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 3, 0, 1])
    windows, steps, min_len = SpeechLMTrainingModule.sampling_context(batch, 2, torch.tensor([4, 8]), rows,
                                                                      scored_steps)  # fmt: skip
    # row 0 scores 4 positions (3 tokens + EOS), row 1 scores 2, in row-major order
    assert windows.tolist() == [[-1, -1], [-1, 5], [5, 6], [6, 7], [-1, -1], [-1, 8]]
    assert steps.tolist() == [0, 1, 2, 3, 0, 1]
    assert min_len.tolist() == [4, 4, 4, 4, 8, 8]


def test_sampling_stop_tokens_must_fit_the_head(training_world):
    target = CosyVoice2LM.from_dir(training_world["target"])
    with pytest.raises(ValueError, match="do not fit the model's head.*the target's own stop_tokens"):
        SpeechLMTrainingModule(_draft(target), target, agreement_sampling=SamplingConfig(stop_tokens=(1024,)))


def _adam_steps(ckpt: dict) -> set[int]:
    return {int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()}


def test_train_exports_the_draft_and_resume_continues_steps_and_optimizer(training_world, tmp_path):
    from ssd.training.train import train

    run = tmp_path / "run"
    first = train(compose_train_config(training_world, run, "max_steps=6", "val_every_steps=3"))
    assert first["global_step"] == 6
    assert 0.0 < first["before/dev/alpha_softmax"] < 1.0 and 0.0 < first["dev/alpha_softmax"] < 1.0
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    target = CosyVoice2LM.from_dir(training_world["target"])
    draft = load_draft(run / "draft.pt", target)
    trainable = {f"model.{k}" for k, p in draft.named_parameters() if p.requires_grad}
    assert set(last["state_dict"]) == trainable  # last.ckpt holds the trained tensors only
    for key, value in draft.named_parameters():
        if value.requires_grad:
            assert torch.equal(value, last["state_dict"][f"model.{key}"])
    assert (run / "checkpoints" / "draft-best.pt").is_file()
    assert _adam_steps(last) == {6}

    second = train(compose_train_config(training_world, run, "max_steps=10", "val_every_steps=3"))
    assert second["global_step"] == 10
    assert second["before/dev/alpha_softmax"] == first["before/dev/alpha_softmax"]  # kept from the first run
    resumed = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert _adam_steps(resumed) == {10}  # AdamW's state continued from step 6, not restarted
    assert resumed["lr_schedulers"][0]["last_epoch"] == 10
    assert sorted(p.name for p in (run / "csv").iterdir()) == [
        "version_0",
        "version_1",
    ]  # nothing overwritten


def test_train_target_trains_all_parameters_and_writes_a_model_dir(training_world, tmp_path):
    from ssd.training.train import train

    run = tmp_path / "target_run"
    metrics = train(compose_train_config(training_world, run, "train_target=true", "kd_weight=0", "max_steps=3",
                                         "val_every_steps=3"))  # fmt: skip
    assert metrics["dev/ce"] < metrics["before/dev/ce"]
    trained = CosyVoice2LM.from_dir(run / "target")
    original = CosyVoice2LM.from_dir(training_world["target"])
    moved = [k for k, v in trained.state_dict().items() if not torch.equal(v, original.state_dict()[k])]
    assert any(k.startswith("backbone.layers.0.") for k in moved) and "llm_decoder.weight" in moved


def test_schema_rejects_typos_that_struct_mode_lets_through(training_world, tmp_path):
    cfg = compose_train_config(training_world, tmp_path, "+data.max_tokenz=5")
    with pytest.raises(
        ValueError, match=r"config data: unknown key\(s\) \['max_tokenz'\].*TokenShardDataModule"
    ):
        validate_train_config(cfg)
    appended = compose_train_config(training_world, tmp_path, "+optim.lrr=1")  # Hydra's open_dict lets `+` in
    with pytest.raises(ValueError, match=r"Key 'lrr' not in 'OptimConfig'"):
        validate_train_config(appended)
    with pytest.raises(ValueError, match="kd_weight > 0 needs a teacher"):
        validate_train_config(
            compose_train_config(training_world, tmp_path, "train_target=true", "kd_weight=0.5")
        )
    with pytest.raises(ValueError, match="optim.schedule"):
        validate_train_config(compose_train_config(training_world, tmp_path, "optim.schedule=cosin"))


def test_dev_alpha_of_a_repetition_penalty_law_says_it_leaves_the_penalty_out(training_world, caplog):
    """Teacher-forced dev rows hold no prompt ids, so the whole-context law cannot be applied there: the
    module measures alpha without the penalty and says so, instead of silently scoring another law."""
    target = CosyVoice2LM.from_dir(training_world["target"])
    sampling = SamplingConfig(top_k=25, stop_tokens=(61, 62, 63), repetition_penalty=1.2)
    with caplog.at_level("WARNING"):
        module = SpeechLMTrainingModule(_draft(target), target, agreement_sampling=sampling)
    assert module.agreement_sampling.repetition_penalty is None
    assert module.agreement_sampling.top_k == 25
    assert "repetition_penalty=1.2" in caplog.text


class _RunsCodeWhenUnpickled:
    """What a tampered checkpoint can hold: unpickling it calls open(marker, "w")."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_resume_refuses_a_checkpoint_whose_unpickling_runs_code(training_world, tmp_path):
    from ssd.training.train import train

    run = tmp_path / "run"
    marker = tmp_path / "code_ran"
    (run / "checkpoints").mkdir(parents=True)
    torch.save(
        {"state_dict": {}, "payload": _RunsCodeWhenUnpickled(marker)}, run / "checkpoints" / "last.ckpt"
    )
    with pytest.raises(
        ValueError, match=r"not resuming: .*last.ckpt was not loaded: .*whose unpickling would run code"
    ):
        train(compose_train_config(training_world, run, "max_steps=2", "val_every_steps=2"))
    assert not marker.exists()
    # Negative control: the same file loaded the way resume used to load it runs the payload.
    torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize(
    "env, zero",
    [
        ({}, True),
        ({"RANK": "0", "LOCAL_RANK": "0"}, True),  # torchrun
        ({"RANK": "8", "LOCAL_RANK": "0", "NODE_RANK": "1"}, False),  # torchrun, second node's first GPU
        ({"NODE_RANK": "1"}, False),  # Lightning's launcher: the second node's first process
        ({"NODE_RANK": "0", "LOCAL_RANK": "1"}, False),  # ... a process it started on the first node
        ({"SLURM_PROCID": "0"}, True),  # srun, first task
        ({"SLURM_PROCID": "5"}, False),  # srun, another task
        ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, False),  # Lightning's launcher inside one SLURM task
    ],
)
def test_global_rank_zero_from_each_launchers_environment(env, zero):
    from ssd.training.train import is_global_rank_zero

    assert is_global_rank_zero(env) is zero


def test_the_second_nodes_first_process_shares_the_run_dir_lock(tmp_path, monkeypatch):
    """Two nodes on a shared filesystem: node 0's rank 0 holds the lock; node 1's first process (LOCAL_RANK 0,
    NODE_RANK 1) must run inside it. A second training on node 0 is still refused."""
    from ssd.files import RunDirLock
    from ssd.training.train import training_dir_lock

    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    with RunDirLock(tmp_path, "training run"):
        monkeypatch.setenv("NODE_RANK", "1")
        with training_dir_lock(tmp_path):
            pass
        monkeypatch.setenv("NODE_RANK", "0")
        with pytest.raises(Exception, match="in use"), training_dir_lock(tmp_path):
            pass
