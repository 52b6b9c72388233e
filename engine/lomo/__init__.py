"""LOMO and AdaLomo: full-parameter fine-tuning with the update fused into the backward pass.

LOMO ("Full Parameter Fine-tuning for Large Language Models with Limited Resources", Lv et al.
2023) applies SGD to each parameter as soon as its gradient is computed and frees the gradient,
so neither a full set of gradients nor optimizer state is ever held. AdaLomo ("AdaLomo:
Low-memory Optimization with Adaptive Learning Rate", Lv et al. 2023) adds Adafactor-style
factored second moments (a row and a column vector per matrix) and update normalisation.

Why our own implementation and not `lomo-optim` (0.1.1, installed): checked on this machine's
CPU under ZeRO 0 and 3 with 2 ranks,

- its `AdaLomo` cannot be built without CUDA (it allocates its moments with `.cuda()`:
  "Torch not compiled with CUDA enabled");
- its `Lomo` runs, but outside ZeRO-3 it never averages gradients over the data-parallel
  ranks: after one step the two ranks' weights differ (measured), each rank trains its own model;

and, reading its code: the loss scale is only ever lowered (the scale never grows back after an
overflow); without clipping an fp16 overflow is found halfway through the update, after some
parameters have already changed; every hook call scans all parameters (quadratic in their
number); under ZeRO-3 it writes only the partition, so persistent small parameters keep their
old gathered values; and its ZeRO-3 clipping backs up twice through one graph, which ZeRO-3's
released parameters do not allow. DeepSpeed 0.19 also refuses `loss.backward()` on its engine's
outputs without a DeepSpeed optimizer, which its usage assumes.

So: :mod:`engine.lomo.rules` (the two update rules, plain tensor math), :mod:`engine.lomo.scaler`
(fp16 dynamic loss scaling), :mod:`engine.lomo.fused` (hooks, the measure and update passes,
data-parallel averaging, ZeRO-3 partitions) and :mod:`engine.lomo.step` (the step strategy and
the set-up builders, which the fused method object of :mod:`engine.model.methods` uses).
"""

from engine.lomo.fused import FusedOptimizer
from engine.lomo.rules import AdaLomoRule, LomoRule, UpdateRule
from engine.lomo.scaler import DynamicLossScaler, scaler_from_ds_config
from engine.lomo.step import FusedStep, build_optimizer, prepare_ds_setup

__all__ = ["FusedOptimizer", "AdaLomoRule", "LomoRule", "UpdateRule", "DynamicLossScaler",
           "scaler_from_ds_config", "FusedStep", "build_optimizer", "prepare_ds_setup"]
