"""scripts/services is not open to the machine's other users: a state folder someone else
owns, or a link, is refused; PostgreSQL asks every connection for its password, and the
roles and secrets it makes are the ones docs/getting-started.md promises."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from kvledger.consumer.db import conninfo
from tests.helpers.procs import free_port

pytestmark = pytest.mark.integration
SERVICES = str(Path(__file__).resolve().parents[1] / "scripts" / "services")


def test_a_state_folder_of_someone_else_or_a_link_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for state, why in ((foreign, "belongs to uid 65534"), (link, "symbolic link")):
        done = subprocess.run(
            [SERVICES, "env"], env=dict(os.environ, KVLEDGER_STATE_DIR=str(state)),
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode != 0 and why in done.stderr, done.stderr


def test_a_port_another_process_holds_is_named_before_anything_starts(tmp_path: Path) -> None:
    """A service whose port is taken fails at once with the port and its setting, not with
    the broker's stack trace after it started (or two Kafka listeners on one port)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        other = free_port()
        cases = (
            ("kafka", {"KVLEDGER_KAFKA_PORT": taken, "KVLEDGER_KAFKA_CONTROLLER_PORT": other},
             f"127.0.0.1:{taken} is already in use by another process: choose another port "
             "with KVLEDGER_KAFKA_PORT"),
            ("kafka", {"KVLEDGER_KAFKA_PORT": other, "KVLEDGER_KAFKA_CONTROLLER_PORT": taken},
             "with KVLEDGER_KAFKA_CONTROLLER_PORT"),
            ("kafka", {"KVLEDGER_KAFKA_PORT": other, "KVLEDGER_KAFKA_CONTROLLER_PORT": other},
             f"KVLEDGER_KAFKA_PORT and KVLEDGER_KAFKA_CONTROLLER_PORT are both {other}"),
            ("postgres", {"KVLEDGER_PG_PORT": taken}, "with KVLEDGER_PG_PORT"),
        )  # fmt: skip
        for service, ports, said in cases:
            env = dict(os.environ, KVLEDGER_STATE_DIR=str(tmp_path / "state"))
            env.update({name: str(port) for name, port in ports.items()})
            done = subprocess.run(
                [SERVICES, "up", service], env=env, capture_output=True, text=True,
                timeout=120, check=False,
            )  # fmt: skip
            assert done.returncode != 0 and said in done.stderr, (ports, done.stderr)
            assert "starting" not in done.stderr, done.stderr
    subprocess.run([SERVICES, "down"], env=env, check=False)


def test_postgres_asks_for_passwords_and_the_roles_are_least_privilege() -> None:
    state = Path(tempfile.mkdtemp(prefix="kvledger-privacy-"))
    env = dict(os.environ, KVLEDGER_PG_PORT=str(free_port()), KVLEDGER_STATE_DIR=str(state))
    subprocess.run([SERVICES, "up", "postgres"], env=env, check=True)
    try:
        printed = subprocess.run(
            [SERVICES, "env"], env=env, check=True, capture_output=True, text=True
        ).stdout
        urls = dict(
            line.removeprefix("export ").split("=", 1)
            for line in printed.splitlines()
            if "_DATABASE_URL=" in line
        )
        owner = urls["KVLEDGER_DATABASE_URL"]
        wrong = sa.engine.make_url(owner).set(password="not-the-password")
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            psycopg.connect(conninfo(wrong.render_as_string(hide_password=False))).close()
        with psycopg.connect(conninfo(owner)) as conn:
            row = conn.execute(
                "SELECT rolsuper, rolcreaterole, rolcreatedb FROM pg_roles "
                "WHERE rolname = current_user"
            ).fetchone()
        assert row == (False, False, True)  # owner: scratch databases, no roles, no super
        with psycopg.connect(conninfo(urls["KVLEDGER_LOOKUP_DATABASE_URL"])) as conn:
            member = conn.execute(
                "SELECT pg_has_role(current_user, 'kvledger_reader', 'MEMBER')"
            ).fetchone()
        assert member == (True,)
        # The owner's URL as psql takes it (psql cannot read "+psycopg"): what the demo shows.
        psql_url = next(
            line.split("=", 1)[1] for line in printed.splitlines() if "KVLEDGER_PSQL_URL=" in line
        )
        psql = shutil.which("psql") or str(
            sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))[-1]
        )
        who = subprocess.run(
            [psql, psql_url, "-Atc", "SELECT current_user"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        assert who == sa.engine.make_url(owner).username
        assert stat.S_IMODE(state.stat().st_mode) in (0o700, 0o710)
        secrets = state / "secrets"
        assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
        assert {f.name for f in secrets.iterdir()} >= {"pg_superuser", "pg_owner", "pg_reader"}
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in secrets.iterdir())
        data = next(state.glob("pg-*"))
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
    finally:
        subprocess.run([SERVICES, "down", "postgres"], env=env, check=False)
        subprocess.run(["rm", "-rf", str(state)], check=False)


def test_make_demo_stops_only_what_it_started() -> None:
    """`make demo` stopped every local service at its end, the ones it found running too
    (issue 48's item 18). On services of this test's own (ports and state folder): with
    PostgreSQL already running, the demo starts Kafka, runs, stops Kafka alone; `status`
    names a standby too."""
    state = Path(tempfile.mkdtemp(prefix="kvledger-demo-"))
    env = dict(
        os.environ, KVLEDGER_STATE_DIR=str(state), KVLEDGER_PG_PORT=str(free_port()),
        KVLEDGER_PG_STANDBY_PORT=str(free_port()), KVLEDGER_KAFKA_PORT=str(free_port()),
        KVLEDGER_KAFKA_CONTROLLER_PORT=str(free_port()),
    )  # fmt: skip
    for name in ("KVLEDGER_KAFKA_BOOTSTRAP", "KVLEDGER_DATABASE_URL"):
        env.pop(name, None)
    root = Path(SERVICES).parents[1]
    try:
        subprocess.run([SERVICES, "up", "postgres"], env=env, check=True)
        subprocess.run([SERVICES, "up", "standby"], env=env, check=True)
        status = subprocess.run(  # exit 3: Kafka is not running (yet)
            [SERVICES, "status"], env=env, capture_output=True, text=True, check=False
        )
        assert "standby:    running" in status.stdout, status.stdout
        demo = subprocess.run(
            ["make", "--no-print-directory", "demo", "DEMO_ARGS=--requests 30 --name t_make"],
            cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
        running = subprocess.run(
            [SERVICES, "running"], env=env, capture_output=True, text=True, check=True
        )
        assert running.stdout.split() == ["postgres"], running.stdout
    finally:
        subprocess.run([SERVICES, "down"], env=env, check=False)
        subprocess.run(["rm", "-rf", str(state)], check=False)


def test_a_cluster_setting_or_ports_that_cannot_work_are_refused(tmp_path: Path) -> None:
    """KVLEDGER_KAFKA_BROKERS takes 1 or 3; three brokers take three client ports and three
    controller ports, and two of them the same is said before anything starts."""
    env = dict(os.environ, KVLEDGER_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run(
        [SERVICES, "up", "kafka"], env=dict(env, KVLEDGER_KAFKA_BROKERS="2"),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "KVLEDGER_KAFKA_BROKERS: 1 or 3, not '2'" in done.stderr
    base = free_port()
    overlap = dict(
        env, KVLEDGER_KAFKA_BROKERS="3", KVLEDGER_KAFKA_PORT=str(base),
        KVLEDGER_KAFKA_CONTROLLER_PORT=str(base + 2),
    )  # fmt: skip
    done = subprocess.run(
        [SERVICES, "up", "kafka"], env=overlap, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode != 0, done.stderr
    assert f"give two listeners port {base + 2}: 3 brokers take 3 ports from each" in done.stderr
    assert "starting" not in done.stderr, done.stderr
    env_lines = subprocess.run(
        [SERVICES, "env"], env=dict(overlap, KVLEDGER_KAFKA_CONTROLLER_PORT=str(base + 3)),
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    bootstrap = ",".join(f"127.0.0.1:{base + i}" for i in range(3))
    assert f"export KVLEDGER_KAFKA_BOOTSTRAP={bootstrap}\n" in env_lines


def test_env_warns_when_nothing_of_its_runs_on_the_ports_it_prints(tmp_path: Path) -> None:
    """Ports moved with KVLEDGER_*_PORT are not remembered: a later shell without them got
    the defaults, perhaps someone else's services, and no word of it."""
    env = dict(
        os.environ, KVLEDGER_STATE_DIR=str(tmp_path / "state"),
        KVLEDGER_KAFKA_PORT=str(free_port()), KVLEDGER_PG_PORT=str(free_port()),
    )  # fmt: skip
    done = subprocess.run(
        [SERVICES, "env"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert "export KVLEDGER_KAFKA_BOOTSTRAP=" in done.stdout
    assert "warning: none of these services run" in done.stderr, done.stderr
    assert "KVLEDGER_*_PORT" in done.stderr
