"""A production trace through fleets of simulated engines, every router policy side by side
(`kvledger replay`; README.md here has the module map)."""

# Light on purpose: the command's arguments import these names.
POLICIES = (
    "round_robin",
    "least_loaded",
    "cache_aware",
    "dynamo",
    "kvledger_gpu",
    "kvledger_tiered",
    "mooncake_local",
    "oracle",
    "global_pool",
)
PIPELINE_POLICIES = frozenset({"kvledger_gpu", "kvledger_tiered"})
