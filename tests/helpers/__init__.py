"""Helpers shared by the tests (never imported from another test file)."""
