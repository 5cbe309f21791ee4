"""advise's adaptive budgets are vLLM's own: the installed AdaptiveVerificationManager.get_num_tokens on
a decode batch of the cell, its confidences the schedule's per-position ratios, priced by the
context-aware wrapper (adaptive) or by one context's dense tables built by vLLM's
build_cost_tables_from_curves (adaptive@C)."""

from __future__ import annotations

import numpy as np
import pytest

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av

from dspark_calib.advise import Acceptance, advise
from dspark_calib.pricing.costs import ContextCosts
from dspark_calib.pricing.grid import ContextGrid
from dspark_calib.table.file import read_table
from dspark_calib.vllm import context_aware as ca
from tests.helpers import SHIPPED, aware
from tests.vllm.test_context_aware import STEPS, make_manager, schedule

RATES = (0.9, 0.8, 0.7, 0.55, 0.4, 0.3, 0.2)


@pytest.fixture(scope="module")
def shipped():
    return read_table(SHIPPED, samples=False)


def confident(m, rates):
    """Every slot's confidences: the ratios whose running product is the schedule."""
    r = np.asarray(rates)
    m._stale_confidences[0].np[:] = r / np.concatenate(([1.0], r[:-1]))


@pytest.mark.parametrize("context", [1024, 4096, 16384])
@pytest.mark.parametrize("num_reqs", [1, 4, 8, 32, 256])
def test_adaptive_budgets_are_vllms(shipped, num_reqs, context):
    fp = shipped.fingerprint
    cell = advise(shipped, Acceptance(RATES, "given"), contexts=[context]).cell(num_reqs, context)
    costs = ContextCosts(shipped.curves, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit,
                         extrapolate_to=fp.max_model_len)
    rng = np.random.default_rng(0)
    # one context's tables, as vLLM builds them from that context's curves
    draft, verify = shipped.curves[int(cell.one_context.name.split("@")[1])].as_vllm()
    m = make_manager(av.build_cost_tables_from_curves(draft, verify, fp.max_num_seqs, fp.max_num_batched_tokens,
                                                      fp.cudagraph_limit))
    confident(m, RATES)
    batch = schedule(m, np.full(num_reqs, context, np.int32), [STEPS] * num_reqs, rng)
    assert m.get_num_tokens(*batch) - num_reqs == round(cell.one_context.drafts_per_request * num_reqs)
    # the context-aware wrapper over the same manager, with the plugin's grid
    ca.install(m, ContextGrid(costs), aware())
    assert m.get_num_tokens(*batch) - num_reqs == round(cell.adaptive.drafts_per_request * num_reqs)
    # and the step costs advise reports are the tables the wrapper handed vLLM
    tables = tuple(np.array(a) for a in m.cost_tables)
    b = round(cell.adaptive.drafts_per_request * num_reqs)
    assert (cell.adaptive.draft_ms, cell.adaptive.verify_ms) == (tables[0][num_reqs], tables[1][num_reqs + b])
    assert cell.fixed[STEPS - 1].verify_ms == tables[1][num_reqs * (1 + STEPS)]


def test_the_draft_model_speculator_drafts_without_cuda_graphs():
    """What limitations.md and the draft-model results say of vLLM 0.33: its draft-model speculator
    captures no CUDA graph and runs each draft step eagerly (CUDAGraphMode.NONE), so its time is
    the host's launch path, not the GPU's work, which no cost table or advise models."""
    import inspect

    from vllm.v1.worker.gpu.spec_decode.standalone_ar import speculator as ar

    spec = ar.StandaloneARSpeculator
    for name in ("init_cudagraph_manager", "capture"):
        assert "CUDA graph not yet supported" in inspect.getsource(getattr(spec, name)), name
    run = inspect.getsource(spec._run_model)
    assert "cudagraph_runtime_mode=CUDAGraphMode.NONE" in run
