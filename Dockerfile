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
# Editable: the migrations and alembic.ini are read from /app.
RUN pip install --no-cache-dir -e .
ENTRYPOINT []
CMD ["kvledger", "--help"]
