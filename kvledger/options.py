"""What several commands' arguments share: defaults, settings' variables, and the options
for Kafka, the registry, the database and the log (kvledger.arguments,
kvledger.arguments_consumer and kvledger.arguments_relay use them). Light, as the parser
must be."""

from __future__ import annotations

import argparse

from kvledger.consumer.config import DEFAULT_GROUP
from kvledger.consumer.retention_policy import seconds_arg
from kvledger.parsers import PORT_OR_OFF
from kvledger.settings import ENV_KAFKA, ENV_KAFKA_CONFIG, ENV_REGISTRY, ENV_REGISTRY_CONFIG

# The defaults of modules that import Kafka's client or more (tests/unit/test_cli_help.py
# holds them equal to kvledger.producer.config.DEFAULT_TOPIC, schemas.topics'
# DEFAULT_PARTITIONS, fleet.DEFAULT_MODEL and the relay's ENGINES).
DEFAULT_TOPIC = "kv-events"
DEFAULT_PARTITIONS = 12
DEFAULT_MODEL = "sim-llama-8b"
ENGINES = ("vllm", "sglang", "trtllm")
ENV_LOOKUP_TOKEN = "KVLEDGER_LOOKUP_TOKEN"
ENV_ADMIN = "KVLEDGER_ADMIN_DATABASE_URL"
ENV_READER_PASSWORD = "KVLEDGER_READER_PASSWORD"


def add_kafka_args(p: argparse.ArgumentParser) -> None:
    """--kafka-config FILE and --kafka-set KEY=VALUE: the cluster's client settings
    (security.protocol, sasl.*, ssl.*, …) for every Kafka client the command opens."""
    p.add_argument(
        "--kafka-config",
        metavar="FILE",
        help=f"librdkafka settings as a properties file (else ${ENV_KAFKA_CONFIG}), for every "
        "Kafka client the command opens",
    )
    p.add_argument(
        "--kafka-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more Kafka client setting (repeat; wins over the file)",
    )


def add_registry_args(p: argparse.ArgumentParser) -> None:
    """--schema-registry URL (with its client settings and the subject strategy): Confluent
    Schema Registry framing, for every command that reads or writes the topic."""
    p.add_argument(
        "--schema-registry",
        metavar="URL",
        help=f"Confluent Schema Registry (else ${ENV_REGISTRY}): readers resolve writer schemas "
        "by id and never register; publishers register under the topic's subject",
    )
    p.add_argument(
        "--schema-registry-config",
        metavar="FILE",
        help=f"registry client settings as properties, e.g. basic.auth.user.info, ssl.ca.location "
        f"(else ${ENV_REGISTRY_CONFIG})",
    )
    p.add_argument(
        "--subject-strategy",
        choices=("topic", "record", "topic_record"),
        help="how publishers name the subject: <topic>-value (topic, the default; "
        "$KVLEDGER_SUBJECT_STRATEGY), kvledger.Envelope (record), <topic>-kvledger.Envelope",
    )


def db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", help="SQLAlchemy URL (else $KVLEDGER_DATABASE_URL)")


def bootstrap_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--bootstrap", help=f"{prefix}Kafka bootstrap servers (else ${ENV_KAFKA})")


def log_args(p: argparse.ArgumentParser, group_help: str) -> None:
    """The index's database and the log it is built from: broker, client and registry
    settings, topic, consumer group (consume, verify and rebuild take the same)."""
    db_arg(p)
    bootstrap_arg(p)
    add_kafka_args(p)
    add_registry_args(p)
    p.add_argument("--topic", default=DEFAULT_TOPIC, help="the Kafka topic of events")
    p.add_argument("--consumer-group", dest="group", default=DEFAULT_GROUP, help=group_help)


def silent_after_arg(p: argparse.ArgumentParser, what: str) -> None:
    """--silent-after, the liveness window (units or plain seconds), ``what`` it decides."""
    p.add_argument(
        "--silent-after",
        type=seconds_arg,
        help=f"how long (30, 90s, 5m) {what} (else the database's kvledger.silent_after, 30 s "
        "by default)",
    )


def metrics_args(p: argparse.ArgumentParser) -> None:
    """--metrics-port (0: off) and --metrics-host, for a command that serves /metrics."""
    p.add_argument(
        "--metrics-port", type=PORT_OR_OFF, default=0, help="serve /metrics here (0: off)"
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="interface for /metrics")
