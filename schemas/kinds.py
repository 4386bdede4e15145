"""vLLM's KV-cache spec kinds, in a module of their own: the command line's choices read
them without importing the event classes (``kvledger --help`` stays quick)."""

# vLLM's KV cache spec kinds. Placeholders (block_size 0) are legitimate only for the kinds
# whose offloaded chunks carry no self-describing payload.
FULL_ATTENTION_KINDS = frozenset(
    {
        "full_attention",
        "mla_attention",
        "sink_full_attention",
        "encoder_only_attention",
        "cross_attention",
    }
)
PLACEHOLDER_KINDS = frozenset(
    {"sliding_window", "sliding_window_mla", "mamba", "chunked_local_attention"}
)
SPEC_KINDS = FULL_ATTENTION_KINDS | PLACEHOLDER_KINDS | {"unknown"}
