"""The read side: prefix lookups over the index (see README.md beside this file).

api (Python API over the SQL functions), requests (pure parsing of HTTP bodies), table (the
lookup service's routes), door (the one way in to them), http (the service assembled),
metrics; sql/ holds the current SQL function definitions.
"""

from kvledger.schemas.lookup import Block, Holder, Ranked, Residency
from kvledger.serving.lookup.api import (
    DEFAULT_TIER_WEIGHTS,
    GRANULARITIES,
    Granularity,
    PrefixIndex,
    rank,
)

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "GRANULARITIES",
    "Block",
    "Granularity",
    "Holder",
    "PrefixIndex",
    "Ranked",
    "Residency",
    "rank",
]
