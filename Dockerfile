# The kvledger application image (consumer, lookup service, CLI).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY producer producer
COPY consumer consumer
COPY schemas schemas
COPY kvledger kvledger
COPY migrations migrations
COPY alembic.ini alembic.ini
RUN pip install --no-cache-dir .
ENTRYPOINT []
CMD ["kvledger", "--help"]
