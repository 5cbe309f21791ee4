"""What every mode shares inside vLLM: the mode contract, the one attribute kept on a vLLM
object, the one logger and the once-per-engine log.

The modes (load.py, capture.py, observer.py, context_aware.py) import this, never the
plugin entry point (plugin.py), which imports the modes: imports run one way. Standard
library only, like the entry point.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

STATE_ATTR = "_dspark_state"
# Set on every function we wrap, holding what it wraps: finds our wrappers, undoes them.
MARK = "_dspark_calib_original"

# Under "vllm." so our lines land in vLLM's own log, with its format and level.
log = logging.getLogger("vllm.dspark_calib")


class Mode(Protocol):
    """What a mode provides to the two patched vLLM methods (the whole contract).

    ``batches`` runs in batches_to_profile, on every TP rank; it gets vLLM's own
    batch dicts and yields the dummy-run kwargs vLLM will run and time, each one
    a vLLM dict passed through (``{**batch, ...}``), never rebuilt, and the same
    sequence on every rank (the runs hold collectives): decide on rank 0 and
    broadcast. ``install_curves`` runs in set_initial_cost_curves with one
    timing per yielded batch, in order; it hands vLLM its curves through
    ``original`` (vLLM's rule on given samples) or ``manager.set_cost_curves``.
    Per-engine data goes in ``state_of(manager)``, nowhere else on the manager.
    """

    name: str

    def batches(self, manager: Any, capture_sizes: list[int], vllm_batches: list[dict]) -> Iterator[dict]: ...

    def install_curves(self, manager: Any, samples: list, original: Callable[[list], None]) -> None: ...


@dataclass
class State:
    """Everything dspark-calib keeps on one vLLM object (its only attribute there): the
    adaptive-verification manager, or for observe mode the model runner."""

    vllm_config: Any = None
    mode: Any = None  # the Mode of this engine start, or None: vLLM's own profile
    vllm_fit: Callable | None = None  # vLLM's own set_initial_cost_curves (unbound)
    run: Any = None  # what the mode keeps from batches to install_curves
    context_aware: Any = None  # context_aware.ContextAwareState while installed
    observer: Any = None  # observer.Observer attached to a model runner


def state_of(obj: Any) -> State:
    state = obj.__dict__.get(STATE_ATTR)
    if state is None:
        state = State()
        setattr(obj, STATE_ATTR, state)
    return state


def peek_state(obj: Any) -> State | None:
    """The state if one was ever made (never creates one: a read must not mark vLLM's object)."""
    return getattr(obj, "__dict__", {}).get(STATE_ATTR)


# -- logging: once per engine, from TP rank 0 -----------------------------------------
_logged: set[str] = set()


def _tp_rank() -> int:
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")  # never import vLLM to ask
    if parallel_state is None:
        return 0
    try:
        return int(parallel_state.get_tp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no group yet: a single process
        return 0


def log_once(level: int, message: str) -> None:
    if message in _logged:
        return
    _logged.add(message)
    if _tp_rank() == 0:
        log.log(level, message)


def new_engine() -> None:
    """A new engine's runner is being built: its lines are logged again (a second start in one process too)."""
    _logged.clear()
