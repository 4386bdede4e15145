"""The router index: the prefix index in memory, bootstrapped from PostgreSQL and fed by
Kafka through the same core (index), its store (store) and its lookups (match)."""
