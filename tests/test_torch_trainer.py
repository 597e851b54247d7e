"""`transformers.Trainer` with an offloaded model: its own clipping reads `.grad`, which the
store's gradients have left, so `StoredGradientClipping` clips them to the same max_grad_norm."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import infinity.torch as itorch
from infinity.errors import InvalidRequestError
from tiny_models import gpt2

pytest.importorskip("accelerate")

RTOL = 1e-5


def trainer_losses(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str, *,
                   max_grad_norm: float, callbacks: list[Any] | None = None) -> list[float]:
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": (ids := torch.randint(0, 100, (15,), generator=generator)),
             "labels": ids} for _ in range(10)]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 10)
    args = TrainingArguments(output_dir=folder, max_steps=5, per_device_train_batch_size=2,
                             max_grad_norm=max_grad_norm, report_to=[], save_strategy="no",
                             logging_steps=1, use_cpu=True, disable_tqdm=True, seed=5)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(optimizer, schedule), callbacks=callbacks)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def plain_losses(folder: str, *, max_grad_norm: float) -> list[float]:
    reference = gpt2()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-2, foreach=False)
    return trainer_losses(reference, optimizer, folder, max_grad_norm=max_grad_norm)


def test_trainer_clips_the_stored_gradients_like_plain_pytorch(client: Any, tmp_path: Any
                                                               ) -> None:
    expected = plain_losses(str(tmp_path / "plain"), max_grad_norm=0.25)
    unclipped = plain_losses(str(tmp_path / "unclipped"), max_grad_norm=0)
    assert unclipped != pytest.approx(expected, rel=1e-3)  # the clipping changes the run
    model = itorch.offload(gpt2(), client, namespace="trainer-clip")
    got = trainer_losses(model, itorch.AdamW(model.parameters(), lr=3e-2), str(tmp_path / "ours"),
                         max_grad_norm=0.25, callbacks=[itorch.StoredGradientClipping()])
    assert got == pytest.approx(expected, rel=RTOL)


def test_the_logged_gradient_norm_is_the_stored_gradients(client: Any, tmp_path: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="trainer-norm")
    clipping = itorch.StoredGradientClipping()
    trainer_losses(model, itorch.AdamW(model.parameters(), lr=3e-2), str(tmp_path / "ours"),
                   max_grad_norm=0.25, callbacks=[clipping])
    assert clipping.last_norm is not None and clipping.last_norm > 0


def test_the_callback_with_another_optimizer_is_a_typed_error(tmp_path: Any) -> None:
    model = gpt2()
    with pytest.raises(InvalidRequestError, match="infinity.torch.AdamW"):
        trainer_losses(model, torch.optim.AdamW(model.parameters(), lr=3e-2),
                       str(tmp_path / "plain"), max_grad_norm=0.25,
                       callbacks=[itorch.StoredGradientClipping()])
