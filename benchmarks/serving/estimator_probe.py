"""A vLLM worker extension (EngineArgs.worker_extension_cls) that reads the draft-model
speculator's online acceptance estimator, so a goodput arm can report what the estimator
learned next to the acceptance the synthetic rejection sampler enforces.

vLLM mixes this class into its worker; the harness calls `collective_rpc("estimator_state")`
between workloads (no step is running then). The estimator predicts, per draft position k,
p = sigmoid(slope * f + intercept_k), f being the draft's logit feature; its `predictions`
hold the last prediction per request slot and position. The survival the budget rule uses is
their running product; its mean over the slots used is the learned unconditional acceptance.
"""

from __future__ import annotations

from typing import Any


class EstimatorProbe:
    def estimator_state(self) -> dict[str, Any] | None:
        speculator = getattr(getattr(self, "model_runner", None), "speculator", None)
        est = getattr(speculator, "acceptance_estimator", None)
        if est is None:
            return None
        pred = est.predictions.float()
        used = pred.abs().sum(dim=1) > 0
        survival = pred[used].cumprod(dim=1).mean(dim=0) if bool(used.any()) else None
        return {
            "refits": int(est._refits),
            "slope": float(est.slope.item()),
            "intercepts": [round(float(x), 4) for x in est.intercepts.tolist()],
            "slots": int(used.sum().item()),
            "conditional": [round(float(x), 4) for x in pred[used].mean(dim=0).tolist()] if survival is not None else None,
            "survival": [round(float(x), 4) for x in survival.tolist()] if survival is not None else None,
        }
