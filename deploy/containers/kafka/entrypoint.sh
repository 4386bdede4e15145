#!/bin/sh
# One KRaft node. KAFKA_PORT: the listener port inside, published as the same port on the
# host; KAFKA_ADVERTISED_HOST (default 127.0.0.1) is what clients are told to connect to.
# KAFKA_INTERNAL_HOST (e.g. the compose service name) adds a listener on 29092 for clients
# in other containers.
set -eu
PORT=${KAFKA_PORT:-9092}
HOST=${KAFKA_ADVERTISED_HOST:-127.0.0.1}
LISTENERS="PLAINTEXT://0.0.0.0:$PORT,CONTROLLER://127.0.0.1:9093"
ADVERTISED="PLAINTEXT://$HOST:$PORT"
PROTOCOLS="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
if [ -n "${KAFKA_INTERNAL_HOST:-}" ]; then
  LISTENERS="$LISTENERS,INTERNAL://0.0.0.0:29092"
  ADVERTISED="$ADVERTISED,INTERNAL://$KAFKA_INTERNAL_HOST:29092"
  PROTOCOLS="$PROTOCOLS,INTERNAL:PLAINTEXT"
fi
DIR=/var/lib/kafka
mkdir -p "$DIR/data"
cat > "$DIR/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:9093
listeners=$LISTENERS
advertised.listeners=$ADVERTISED
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$PROTOCOLS
log.dirs=$DIR/data
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
PROPS
cat > "$DIR/log4j2.properties" <<PROPS
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stdout.ref = STDOUT
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
PROPS
CP="/opt/kafka/lib/*"
if [ ! -f "$DIR/data/meta.properties" ]; then
  ID=$(java -cp "$CP" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)
  java -Dlog4j2.configurationFile="$DIR/log4j2.properties" -cp "$CP" kafka.tools.StorageTool \
    format -t "$ID" -c "$DIR/server.properties" > /dev/null
fi
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} -Dlog4j2.configurationFile="$DIR/log4j2.properties" \
  -cp "$CP" kafka.Kafka "$DIR/server.properties"
