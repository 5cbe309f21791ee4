"""The harness's in-engine A/B: one engine, started stock (vLLM's own start-up profile), serves
each workload under vLLM's pricing and under a table's context-aware pricing in turn, so both
pricings meet the same engine. Separate engines of one configuration differ by more than a
pricing does (the draft-model drafter's time above all); the turns (stock, table, table, stock)
give both pricings the same engine and cancel a drift over the run, and the two turns of each
pricing say the noise that is left.

``swap(manager, table, static_context, stock)`` puts a table's pricing on vLLM's
AdaptiveVerificationManager the way load mode does (dspark_calib.vllm.load): the table's curves at
the static context through vLLM's own set_cost_curves, then context-aware pricing from the env
(DSPARK_CALIB_CONTEXT_TAIL / _CHUNKS, read as load mode reads them); with no table it takes the
context-aware wrapper off and puts back the tables vLLM's start-up profile fitted (``stock``, kept
by the caller before the first swap). What it cannot reproduce of a table-loaded engine: the
skipped start-up profile (its compile and memory state) and the probe.

PricingSwapProbe.pricing_swap is the worker-side RPC (mixed into vLLM's worker with the step
timer: estimator_probe.EstimatorProbe); the harness calls it on every worker between workloads
(vLLM's set_cost_curves broadcasts over the TP group, so every rank takes part).
"""

from __future__ import annotations

from typing import Any


def swap(manager: Any, table_path: str | None, static_context: int, stock: Any) -> dict[str, Any]:
    """Put the table's pricing on (table_path) or vLLM's back (None); says what is installed."""
    from dspark_calib.vllm import context_aware as ca

    ca.uninstall(manager)  # back to the static tables under the wrapper, if one is on
    if table_path is None:
        manager.cost_tables = stock
        return {"pricing": "stock", "context_aware": False}
    from dspark_calib.pricing.costs import curves_for_broadcast
    from dspark_calib.table.file import read_table
    from dspark_calib.vllm.load import price_context_aware

    table = read_table(table_path, samples=False)
    if static_context not in table.curves:
        raise ValueError(f"{table_path}: no context {static_context} (has {sorted(table.curves)})")
    draft, verify = table.curves[static_context].as_vllm()
    manager.set_cost_curves(list(draft), list(verify))
    if len(table.curves) >= 2:
        price_context_aware(manager, curves_for_broadcast(table.curves), static_context)
    return {"pricing": "table", "table_hash": table.content_hash[:12], "static_context": static_context,
            "context_aware": ca.is_installed(manager)}


class PricingSwapProbe:
    """The RPC (a method of vLLM's worker once mixed in: self.model_runner is the worker's)."""

    def pricing_swap(self, table_path: str | None, static_context: int = 8192) -> dict[str, Any]:
        from dspark_calib.vllm import context_aware as ca

        manager = getattr(self.model_runner, "adaptive_verification", None)
        if manager is None:
            return {"error": "adaptive verification is off in this engine: no pricing to swap"}
        if not hasattr(self, "_harness_stock_tables"):
            if ca.is_installed(manager):
                return {"error": "this engine loaded a table at start: its tables are not vLLM's own"}
            self._harness_stock_tables = manager.cost_tables
        try:
            return swap(manager, table_path, static_context, self._harness_stock_tables)
        except Exception as exc:  # noqa: BLE001 - the harness reports it; the engine keeps serving
            return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
