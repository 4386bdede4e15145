"""Republishing the index as vLLM ZMQ event streams (`kvledger republish`)."""
