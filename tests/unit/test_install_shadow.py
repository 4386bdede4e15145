"""The install `make venv` makes cannot be shadowed: from the folder that holds a clone
named kvledger (what `git clone` makes), `import kvledger` must still be the installed
package, not the clone's folder taken as an empty namespace package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    done = subprocess.run(
        [sys.executable, *code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_clone_named_kvledger_does_not_shadow_the_install(tmp_path: Path) -> None:
    (tmp_path / "kvledger").symlink_to(ROOT, target_is_directory=True)
    version = _python(["-m", "kvledger", "--version"], tmp_path)
    assert version.startswith("kvledger "), version
    where = _python(
        ["-c", "import kvledger, kvledger.consumer.db as d, kvledger.producer.tracker as t; "
               "print(kvledger.__version__); print(d.__file__); print(t.__file__)"],
        tmp_path,
    )  # fmt: skip
    found, db, tracker = where.splitlines()
    assert found == version.split()[1]
    # The files are the checkout's own (linked), not copies: an edit is seen at once.
    assert Path(db).resolve() == ROOT / "consumer" / "db.py"
    assert Path(tracker).resolve() == ROOT / "producer" / "tracker.py"
