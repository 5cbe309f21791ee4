"""A vLLM worker extension (EngineArgs.worker_extension_cls) that reads the draft-model
speculator's online acceptance estimator, so a goodput arm can report what the estimator
learned next to the acceptance the synthetic rejection sampler enforces.

vLLM mixes this class into its worker; the harness calls `collective_rpc("estimator_state")`
between workloads (no step is running then). The estimator predicts, per draft position k,
p = sigmoid(slope * f + intercept_k), f being the draft's logit feature; its `predictions`
hold the last prediction per request slot and position. The survival the budget rule uses is
their running product; its mean over the slots used is the learned unconditional acceptance.

The one class vLLM mixes in also carries the harness's step timer (step_timer.StepTimerProbe:
step_timer_start, step_timer_take), which runs in every arm, the speculator's estimator or none,
and the in-engine A/B's pricing swap (pricing_swap.PricingSwapProbe: pricing_swap).
"""

from __future__ import annotations

from typing import Any

from pricing_swap import PricingSwapProbe
from step_timer import StepTimerProbe

# never refit: the instance attribute shadows OnlineAcceptanceEstimator.REFIT_INTERVAL, which
# step() reads each step
NEVER = 1 << 62


class EstimatorProbe(StepTimerProbe, PricingSwapProbe):
    def _estimator(self) -> Any:
        speculator = getattr(getattr(self, "model_runner", None), "speculator", None)
        return getattr(speculator, "acceptance_estimator", None)

    def estimator_pin(self, intercepts: list[float]) -> dict[str, Any] | None:
        """The estimator predicts the enforced per-position conditional acceptance and never
        refits: slope 0, intercepts logit(c) (serve_context.pinned_intercepts), written in place (the captured draft graph reads
        these tensors). With dummy weights the drafter's feature is the same for every draft, so
        vLLM's own fit has nothing to learn from and its float32 IRLS steps can run away; pinned,
        the budgets follow the acceptance the synthetic sampler enforces and the arms differ only
        in pricing."""
        import torch

        est = self._estimator()
        if est is None:
            return None
        est.slope.fill_(0.0)
        est.intercepts.copy_(torch.tensor(intercepts, dtype=est.intercepts.dtype,
                                          device=est.intercepts.device))
        est.REFIT_INTERVAL = NEVER
        return self.estimator_state()

    def estimator_state(self) -> dict[str, Any] | None:
        est = self._estimator()
        if est is None:
            return None
        pred = est.predictions.float()
        used = pred.abs().sum(dim=1) > 0
        survival = pred[used].cumprod(dim=1).mean(dim=0) if bool(used.any()) else None
        feat = est.features.float()[used]  # logit(max draft prob) per slot and position
        return {
            "refits": int(est._refits),
            "slope": float(est.slope.item()),
            "intercepts": [round(float(x), 4) for x in est.intercepts.tolist()],
            "slots": int(used.sum().item()),
            "conditional": [round(float(x), 4) for x in pred[used].mean(dim=0).tolist()] if survival is not None else None,
            "survival": [round(float(x), 4) for x in survival.tolist()] if survival is not None else None,
            "feature": ({"mean": round(float(feat.mean()), 4), "std": round(float(feat.std()), 6),
                         "min": round(float(feat.min()), 4), "max": round(float(feat.max()), 4)}
                        if feat.numel() > 1 else None),
            "pinned": getattr(est, "REFIT_INTERVAL", None) == NEVER,
        }
