"""mooncaked.conductor: global prefix index, cost models and placement (pure, no I/O).

- `index.PrefixIndex`: block key -> holders per tier, fed by store events.
- `cost_model.CostModel`: prefill / decode step / transfer predictions, JSON round trip,
  `paper_cost_model()` and `fit_cost_model()`.
- `policy.place`: Mooncake Algorithm 1 with cache load balancing, and its baselines.
"""

from .cost_model import CostModel, PolyModel, TransferModel, fit_cost_model, paper_cost_model
from .index import BlockEvent, PrefixIndex
from .policy import (POLICIES, Fetch, Placement, PlacementRequest, PolicyConfig, Rejection,
                     Snapshot, place)

__all__ = ["BlockEvent", "CostModel", "Fetch", "POLICIES", "Placement", "PlacementRequest",
           "PolicyConfig", "PolyModel", "PrefixIndex", "Rejection", "Snapshot", "TransferModel",
           "fit_cost_model", "paper_cost_model", "place"]
