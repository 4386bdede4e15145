# The kvledger application image (consumer, lookup service, CLI).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY producer producer
COPY consumer consumer
COPY schemas schemas
COPY kvledger kvledger
COPY migrations migrations
# Installed as a wheel (migrations included); kvledger/ links to the folders above.
RUN pip install --no-cache-dir -c constraints.txt '.[all]' && rm -rf /app/*
# Not root: a user of its own, with no home and no shell.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvledger
USER 10001
ENTRYPOINT []
CMD ["kvledger", "--help"]
