"""How many tokens to draft each step, apart from the decoding mechanism: `acceptance` (estimates),
`costs` (the cost model), `decision` (the rule), `adaptive` (the policy tying them), `protocol`."""

from .acceptance import PRIOR_ACCEPTANCE, PRIOR_WEIGHT, AcceptanceEstimate, TreeAcceptance, beta_mean
from .adaptive import DEVICE_COSTS, AdaptiveDraftLength, AdaptiveSettings, DeviceCosts
from .costs import CostModel
from .decision import expected_gains, fastest_width, speedups
from .protocol import DraftLengthPolicy, FixedDraftLength

__all__ = [
    "AcceptanceEstimate", "AdaptiveDraftLength", "AdaptiveSettings", "CostModel", "DEVICE_COSTS",
    "DeviceCosts", "DraftLengthPolicy", "FixedDraftLength", "PRIOR_ACCEPTANCE", "PRIOR_WEIGHT",
    "TreeAcceptance", "beta_mean", "expected_gains", "fastest_width", "speedups",
]  # fmt: skip
