"""Every code block of README.md and docs/ runs as written, against the test services, or
says just before it why it does not (``<!-- not run: REASON -->``).

Shell blocks run line by line in bash with the test services' variables, where the docs'
``eval "$(scripts/services env)"`` is replaced by them, and each ``--topic NAME`` becomes a
topic of this run's own (``NAME-<suffix>``, deleted afterwards); Python blocks run in a fresh
interpreter with the same variables. Blocks run in reading order (README.md, then docs/ in
the README's table's order), in one environment: a fresh database, the shared broker, and a
`kvledger serve` for the client's example. The README stays short, and every relative link
of the docs names a file that exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.procs import first_answer, free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SERVICES_ENV = 'eval "$(scripts/services env)"'
_FENCE = re.compile(r"^( *)```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!-- not run: (.+\S) -->$")


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    code: str
    not_run: str | None  # the reason, when the README says it is not run


@dataclass(frozen=True)
class Located:
    """A block and the document it is in."""

    doc: str
    block: Block

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.block.line}"

    @property
    def language(self) -> str:
        return self.block.language

    @property
    def code(self) -> str:
        return self.block.code

    @property
    def not_run(self) -> str | None:
        return self.block.not_run


def blocks(text: str) -> list[Block]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, language, start = len(opened.group(1)), opened.group(2), i
        i += 1
        body = []
        while not _FENCE.match(lines[i]):
            body.append(lines[i][indent:])
            i += 1
        before = lines[start - 1].strip() if start else ""
        reason = m.group(1) if (m := _NOT_RUN.match(before)) else None
        out.append(Block(start + 1, language, "\n".join(body) + "\n", reason))
        i += 1
    return out


# Reading order: the README, then docs/ as the README's table lists them.
DOCS = ["README.md", *re.findall(r"\]\((docs/[\w-]+\.md)\)", (ROOT / "README.md").read_text())]
README = [
    Located(doc, block) for doc in dict.fromkeys(DOCS) for block in blocks((ROOT / doc).read_text())
]
_TOPIC = re.compile(r"(--topic\s+)([\w.-]+)")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_code_block_runs_or_says_why_not() -> None:
    code = [b for b in README if b.language in ("sh", "python")]
    assert len([b for b in code if b.not_run is None]) >= 4
    # A block of commands has a language; text blocks (diagrams, SQL shown) have none or sql.
    untagged = [b.where for b in README if b.language == "" and re.search(r"^kvledger ", b.code)]
    assert untagged == []
    assert all(b.not_run is None or len(b.not_run) > 10 for b in code)


def test_the_readme_is_short_and_every_doc_is_listed() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    listed = {Path(doc).name for doc in DOCS[1:]}
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_every_relative_link_names_a_file() -> None:
    missing = []
    for doc in dict.fromkeys(DOCS):
        for target in _LINK.findall((ROOT / doc).read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not ((ROOT / doc).parent / target).exists():
                missing.append(f"{doc}: {target}")
    assert missing == []


@pytest.fixture(scope="module")
def readme_env(kafka_bootstrap: str, database_url: str) -> Iterator[dict[str, str]]:
    """The variables the README's blocks run with, and a lookup service for the client."""
    import uuid

    from kvledger.consumer.db import create_database, drop_database, migrate

    name = f"kvl_readme_{uuid.uuid4().hex[:10]}"
    url = create_database(database_url, name)
    migrate(url)
    port = free_port()
    suffix = uuid.uuid4().hex[:10]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")},
        "KVLEDGER_DOCS_TOPIC_SUFFIX": suffix,
        "KVLEDGER_TOPIC": f"kv-events-{suffix}",  # the Python blocks' topic
        "KVLEDGER_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "KVLEDGER_DATABASE_URL": url,
        "KVLEDGER_LOOKUP_URL": f"http://127.0.0.1:{port}",
        "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
    }
    # Not through helpers.procs.spawn: that one's children end with each test.
    server = subprocess.Popen(
        [sys.executable, "-m", "kvledger", "serve", "--database-url", url, "--allow-writer",
         "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        first_answer(f"http://127.0.0.1:{port}/healthz", "the lookup service", 60)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)
        drop_database(database_url, name)
        _delete_topics(kafka_bootstrap, suffix)


def _delete_topics(bootstrap: str, suffix: str) -> None:
    """The topics the blocks made under this run's suffix (and their dead-letter topics)."""
    import contextlib

    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    ours = [t for t in admin.list_topics(timeout=30).topics if suffix in t]
    if ours:
        for future in admin.delete_topics(ours).values():
            with contextlib.suppress(Exception):
                future.result(timeout=30)


@pytest.mark.parametrize(
    "block",
    [b for b in README if b.language in ("sh", "python") and b.not_run is None],
    ids=lambda b: b.where,
)
def test_the_block_runs(block: Located, readme_env: dict[str, str], tmp_path: Path) -> None:
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    else:
        lines = [ln for ln in block.code.splitlines() if ln.strip() != SERVICES_ENV]
        suffix = readme_env["KVLEDGER_DOCS_TOPIC_SUFFIX"]
        script = _TOPIC.sub(lambda m: f"{m.group(1)}{m.group(2)}-{suffix}", "\n".join(lines))
        argv = ["bash", "-euo", "pipefail", "-c", script]
    done = subprocess.run(
        argv, cwd=ROOT, env=readme_env, capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"
    if "kvledger lookup" in block.code or "LookupClient(" in block.code:
        # First steps and the client's example end in a hit, not a miss.
        assert "route to" in done.stdout, f"{block.where}: no hit\n{done.stdout}"
    if "kvledger lookup" in block.code:  # the simulated fleet has a GPU tier, as engines do
        assert re.search(r"\bGPU\b", done.stdout), f"{block.where}: no GPU\n{done.stdout}"
    assert "Traceback" not in done.stderr, done.stderr


def test_the_sql_page_lists_the_schema(readme_env: dict[str, str]) -> None:
    """docs/sql.md names every function, view and table of a migrated schema, and nothing
    the schema lacks (a partition is its table's; an overload is one name)."""
    from kvledger.consumer.db import connect

    with connect(readme_env["KVLEDGER_DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute(
            "SELECT proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'kvledger'"
            " UNION SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'kvledger' AND c.relkind IN ('r', 'p', 'v', 'm')"
            " AND NOT c.relispartition"
        ).fetchall()
    schema = {name for (name,) in rows}
    page = (ROOT / "docs" / "sql.md").read_text()
    # The first cell of each table row: one name, or several (`a` / `b`, `a`, `b`).
    listed = {
        name
        for cell in re.findall(r"^\| (`[^|]+) \|", page, re.M)
        for name in re.findall(r"`(\w+)(?:\(|`)", cell)
    }
    assert listed == schema, (f"missing: {sorted(schema - listed)}, "
                              f"not in the schema: {sorted(listed - schema)}")  # fmt: skip
