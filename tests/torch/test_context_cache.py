"""Plan contexts (device tables) are cached for recent plans only, so rebuilds do not pile up."""

import numpy as np

from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.torch import plan_context


def _plan(seed: int) -> HaloPlan:
    pos = np.random.default_rng(seed).uniform(0.0, 6.0, (12, 3))
    return HaloPlan.build(pos, np.eye(3) * 6.0, cutoff=1.5, n_devices=1)


def test_recent_plans_hit_the_cache_and_old_ones_are_evicted():
    plan_context._CONTEXTS.clear()
    plans = [_plan(s) for s in range(plan_context._MAX_CONTEXTS + 5)]
    ctxs = [plan_context.context_for(p) for p in plans]
    assert len(plan_context._CONTEXTS) == plan_context._MAX_CONTEXTS
    assert plan_context.context_for(plans[-1]) is ctxs[-1]  # recent: same context
    old = plan_context.context_for(plans[0])  # evicted: rebuilt, still valid for its plan
    assert old is not ctxs[0] and old.plan is plans[0] and old.n_owned == 12
    assert len(plan_context._CONTEXTS) == plan_context._MAX_CONTEXTS
