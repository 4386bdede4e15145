# The kvledger application image (consumer, lookup service, CLI), for Docker users.
# Stage one builds the wheels, kvledger's compiled core (rust/, PyO3, abi3) among them, with
# a Rust toolchain that stays behind; stage two installs them on a slim Python.
FROM rust:1-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md constraints.txt setup.py ./
COPY rust rust
COPY producer producer
COPY consumer consumer
COPY serving serving
COPY schemas schemas
COPY kvledger kvledger
COPY migrations migrations
RUN python3 -m venv /opt/build && KVLEDGER_REQUIRE_CORE=1 /opt/build/bin/pip wheel -q \
    -c constraints.txt -w /wheels '.[all]'

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'kvledger[all]' \
    && python -c 'import kvledger._core' && rm -rf /wheels
# Not root: a user of its own, with no home and no shell.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvledger
USER 10001
ENTRYPOINT []
CMD ["kvledger", "--help"]
