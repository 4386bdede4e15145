"""The router's pure-Python reference implementations (see group.py)."""
