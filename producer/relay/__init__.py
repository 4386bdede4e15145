"""``kvledger relay``: a stock vLLM engine's ZMQ KV events into Kafka (see relay.py)."""
