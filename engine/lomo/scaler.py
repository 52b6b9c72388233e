"""Dynamic loss scaling for the fused fp16 update.

fp16 gradients underflow unless the loss is scaled up before backward; too large a scale makes
them overflow to inf. The scaler halves the scale on every overflow (the step is skipped) and
doubles it after `growth_interval` clean steps in a row, so it grows back after a spike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000   # clean steps before the scale grows
    min_scale: float = 1.0
    dynamic: bool = True          # False: a static scale that never changes
    clean_steps: int = 0          # clean steps since the last overflow or growth
    overflows: int = 0            # steps skipped so far

    def update(self, overflow: bool) -> None:
        """Record one step's outcome and move the scale."""
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.overflows = int(state.get("overflows", 0))


def scaler_from_ds_config(ds_config: dict) -> DynamicLossScaler | None:
    """A scaler following DeepSpeed's fp16 section (initial_scale_power, loss_scale_window,
    min_loss_scale, loss_scale > 0 for a static scale); None when fp16 is off."""
    fp16 = ds_config.get("fp16") or {}
    if not fp16.get("enabled"):
        return None
    static = float(fp16.get("loss_scale", 0) or 0)
    if static > 0:
        return DynamicLossScaler(scale=static, dynamic=False)
    return DynamicLossScaler(scale=2.0 ** int(fp16.get("initial_scale_power", 16)),
                             growth_interval=int(fp16.get("loss_scale_window", 1000)),
                             min_scale=float(fp16.get("min_loss_scale", 1)))
