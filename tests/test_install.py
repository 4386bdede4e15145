"""The built wheel, installed into a fresh virtual environment outside the checkout, migrates
a database and consumes a topic: the migrations ship inside the package, and nothing is
installed under the top-level names producer, consumer or schemas.

The fresh environment borrows the test environment's third-party packages (a .pth file),
so the test needs no package index beyond the build's own requirements.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kvledger.consumer.db import connect
from tests.helpers.streams import Stream, removed, spec, stored

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{args[:3]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel built from this checkout; returns its bin folder."""
    work = tmp_path_factory.mktemp("install")
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work), str(ROOT)], work
    )
    [wheel] = work.glob("kvledger-*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], work)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # Third-party packages from the test environment (not kvledger: its editable finder
    # lives in a .pth file, which a path added this way does not run).
    (purelib / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)], work)
    return venv / "bin"


def test_the_installed_package_has_one_namespace(installed: Path, tmp_path: Path) -> None:
    out = _run(
        [str(installed / "python"), "-c",
         "import importlib.util as u, kvledger.consumer.db as d; "
         "print(d.__file__); "
         "print([u.find_spec(n) for n in ('producer', 'consumer', 'serving', 'schemas')])"],
        tmp_path,
    )  # fmt: skip
    module_file, specs = out.splitlines()
    assert str(installed.parent) in module_file and str(ROOT) not in module_file
    assert specs == "[None, None, None, None]"
    version = _run([str(installed / "python"), "-m", "kvledger", "--version"], tmp_path)
    assert version.startswith("kvledger ")  # `python -m kvledger` is the command too


def test_the_installed_command_migrates_and_consumes(
    installed: Path, tmp_path: Path, fresh_database: str, kafka_bootstrap: str, make_topic, group_id
) -> None:
    # fresh_database is already migrated: start from an empty schema to see migrate work.
    with connect(fresh_database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA kvledger CASCADE")
        conn.execute("DROP SCHEMA kvledger_migrations CASCADE")
    kvledger = str(installed / "kvledger")
    _run([kvledger, "migrate", "--database-url", fresh_database], tmp_path)
    topic = make_topic("install", partitions=1)
    stream = Stream(topic)
    stream.send("engine-0", spec(0))
    stream.send("engine-0", stored([1, 2, 3]))
    stream.send("engine-0", removed([3]))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for m in stream.messages:
        producer.produce(topic, value=m.value, key=m.key, partition=0)
    assert producer.flush(30) == 0
    _run(
        [kvledger, "consume", "--bootstrap", kafka_bootstrap, "--database-url", fresh_database,
         "--topic", topic, "--consumer-group", group_id, "--dlq-topic", f"{topic}.dlq",
         "--until-caught-up", "--no-migrate"],
        tmp_path,
    )  # fmt: skip
    with connect(fresh_database, autocommit=True) as conn:
        held = conn.execute("SELECT count(*) FROM kvledger.residencies").fetchone()
        applied = conn.execute(
            "SELECT count(*) FROM kvledger.events WHERE status = 'applied'"
        ).fetchone()
    assert held == (2,) and applied == (3,)


def _site_size(venv: Path) -> int:
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    return sum(f.stat().st_size for f in purelib.rglob("*") if f.is_file())


def test_the_base_install_publishes_and_nothing_more(
    tmp_path: Path, kafka_bootstrap: str, make_topic
) -> None:
    """`pip install kvledger` (no extra) is what an engine needs: the producer, the contract
    and the hashing, at constraints.txt's versions; the server side is left out, and its
    commands say which extra brings them."""
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
         tmp_path)  # fmt: skip
    [wheel] = tmp_path.glob("kvledger-*.whl")
    venv = tmp_path / "base"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
          "-c", str(ROOT / "constraints.txt"), str(wheel)], tmp_path, timeout=600)  # fmt: skip
    absent = _run(
        [python, "-c", "import importlib.util as u; print([n for n in ('sqlalchemy', 'psycopg', "
         "'alembic', 'starlette', 'uvicorn', 'zmq', 'msgspec', 'prometheus_client') "
         "if u.find_spec(n) is not None])"],
        tmp_path,
    )  # fmt: skip
    assert absent.strip() == "[]"
    topic = make_topic("base", partitions=3)
    kvledger = str(venv / "bin" / "kvledger")
    out = _run([kvledger, "simulate", "--bootstrap", kafka_bootstrap, "--topic", topic,
                "--requests", "5", "--seed", "1", "--partitions", "3"], tmp_path)  # fmt: skip
    assert "acknowledged" in out
    from confluent_kafka import Consumer, TopicPartition

    probe = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "probe"})
    try:
        ends = [probe.get_watermark_offsets(TopicPartition(topic, i), timeout=10)[1]
                for i in range(3)]  # fmt: skip
    finally:
        probe.close()
    assert sum(ends) > 5  # announcements and events, all acknowledged
    digest = _run(
        [python, "-c", "from kvledger.schemas.hashing import prompt_block_hashes as h; "
         "import kvledger.client; "  # the lookup client needs no extra either
         "print(len(h(list(range(12)), 4, 'xxhash_cbor', seed='0')))"],
        tmp_path,
    )  # fmt: skip
    assert digest.strip() == "3"
    # The CLI is there; a server command names its extra instead of a traceback.
    assert "simulate" in _run([kvledger, "--help"], tmp_path)
    refused = subprocess.run(
        [kvledger, "consume"], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 1
    assert "pip install 'kvledger[consumer]'" in refused.stderr, refused.stderr
    print(f"\nbase install: {_site_size(venv) / 1e6:.1f} MB of site-packages")
