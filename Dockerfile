# The kvledger application image (consumer, lookup service, CLI).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY producer producer
COPY consumer consumer
COPY schemas schemas
COPY kvledger kvledger
COPY migrations migrations
COPY setup.py ./
# Installed as a wheel (migrations included); kvledger/ links to the folders above. The C
# compiler is there only while the compiled parts (the .c files setup.py lists) are built.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir -c constraints.txt '.[all]' \
    && python -c 'import kvledger.consumer.router._masks, kvledger.schemas._avro, kvledger.producer._vllm' \
    && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/* /app/*
# Not root: a user of its own, with no home and no shell.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvledger
USER 10001
ENTRYPOINT []
CMD ["kvledger", "--help"]
