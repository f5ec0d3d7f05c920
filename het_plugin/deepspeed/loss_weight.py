"""The last pipeline stage's loss weight under an uneven replica split, exact in low precision.

Replica ``d`` runs ``c = counts[d]`` micro-batches; DeepSpeed 0.19.8's ``DeepSpeedEngine.backward``
(runtime/engine.py) divides each micro-batch's loss by ``gradient_accumulation_steps()`` (= c here), and the
even split's gradient wants ``1/n`` (``n``: the plan's even count). The pipeline's last stage reaches that
``backward`` through the instruction map (:func:`het_plugin.deepspeed.replicas._weight_pipeline_backward`), so
the loss is multiplied by ``c/n`` first. Done in the loss's dtype, a bf16 loss gives the backward seed
from two bf16 roundings (of ``c/n`` times the gradient, and of its division by c), one bf16 step away from the
even split's ``bf16(1/n)`` for some counts (c = 7 with n = 3, for one): every gradient of that micro-batch would
be scaled by ``1 +- 2^-8``. In fp32 the seed is ``1/n`` to within a few fp32 roundings, and rounding it back to
the loss's dtype gives the even split's own seed: each micro-batch's bf16 gradient is then the even split's,
bit for bit (tests/deepspeed/test_deepspeed_user_cases.py checks every c, n up to 16). fp32 losses are unchanged.
"""
from __future__ import annotations


def weighted_loss(loss, factor: float):
    """``loss * factor`` computed in fp32 (at least): the seed DeepSpeed's division by gas then hands the
    model is the even split's."""
    import torch
    if loss.is_floating_point() and torch.finfo(loss.dtype).bits < 32:
        loss = loss.float()
    return loss * factor
