"""`StoredGradientClipping`: gradient clipping for `transformers.Trainer` when the gradients are
in the store.

Trainer clips with `torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)`, which
reads `.grad`; an offloaded model's gradients left the process as they were produced, so that
call sees none and clips nothing (it returns a norm of 0). Pass this callback to the Trainer
(`Trainer(..., callbacks=[StoredGradientClipping()])`): just before the optimizer step it clips
the stored gradients to the same `args.max_grad_norm` with the optimizer's own
`clip_grad_norm_`, and records the norm it found in the next log entry as `grad_norm`.

Imported on its own (`from infinity.torch.trainer import StoredGradientClipping`, or as
`infinity.torch.StoredGradientClipping`), so the rest of `infinity.torch` does not need
transformers.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from infinity.errors import InvalidRequestError

__all__ = ["StoredGradientClipping"]


class StoredGradientClipping(TrainerCallback):  # type: ignore[misc]
    """Clips the store's gradients to `args.max_grad_norm` before each optimizer step."""

    def __init__(self) -> None:
        self.last_norm: float | None = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if args.max_grad_norm is None or args.max_grad_norm <= 0:
            return control
        optimizer = _store_optimizer(kwargs.get("optimizer"))
        self.last_norm = float(optimizer.clip_grad_norm_(float(args.max_grad_norm)))
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> Any:
        if logs is not None and self.last_norm is not None and "grad_norm" in logs:
            logs["grad_norm"] = self.last_norm  # Trainer's own figure read no gradients
        return control


def _store_optimizer(optimizer: Any) -> Any:
    """The infinity optimizer inside what Trainer hands callbacks (Accelerate wraps it)."""
    from infinity.torch.optim import _StoreAdam

    seen = optimizer
    while seen is not None and not isinstance(seen, _StoreAdam):
        seen = getattr(seen, "optimizer", None)
    if seen is None:
        raise InvalidRequestError(
            "StoredGradientClipping needs the Trainer's optimizer to be infinity.torch.AdamW or "
            "Adam (pass optimizers=(AdamW(model.parameters()), scheduler) to the Trainer); "
            "for another optimizer, leave this callback out")
    return seen
