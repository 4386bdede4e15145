"""The fuzz targets (tests/fuzz/targets.py) over their seed corpus: every seed passes, so a
fuzz run starts from inputs that hold, and the inputs that once broke kvledger (a negative
union branch, over-long and overflowing varints, more lookahead lists than hashes) stay
regression cases of every test run. `python -m tests.fuzz` fuzzes from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz.targets import TARGETS

CORPUS = Path(__file__).parent.parent / "fuzz" / "corpus"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_seed_holds(name: str) -> None:
    seeds = sorted((CORPUS / name).iterdir())
    assert len(seeds) >= 5, f"the {name} corpus is missing (python -m tests.fuzz.seeds)"
    for seed in seeds:
        TARGETS[name](seed.read_bytes())


def test_the_runner_runs_every_target() -> None:
    from tests.fuzz.__main__ import NAMES

    assert set(NAMES) == set(TARGETS)


def test_the_malformed_envelope_seeds_are_refused_by_the_codec_and_oracle() -> None:
    from tests.fuzz.targets import CODEC, ORACLE, _verdict

    refused = [
        seed.name
        for seed in (CORPUS / "envelope").iterdir()
        if _verdict(CODEC, seed.read_bytes()) == ("rejected", "undecodable")
        and _verdict(ORACLE, seed.read_bytes()) == ("rejected", "undecodable")
    ]
    assert len(refused) >= 3
