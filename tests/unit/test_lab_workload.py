"""The lab's request stream (bench/lab/workload.py): deterministic, in order of arrival,
and with the bursts the freshness issue asks about: a new document asked by several users
at once."""

from __future__ import annotations

import itertools
from collections import defaultdict

from bench.lab.workload import Shape, stream

WORDS = [f"w{i}" for i in range(500)]


def test_the_stream_is_the_same_for_every_router_and_in_order() -> None:
    requests = stream(WORDS)
    assert requests == stream(WORDS)
    assert [r.at for r in requests] == sorted(r.at for r in requests)
    shape = Shape()
    kinds = defaultdict(int)
    for r in requests:
        kinds[r.kind] += 1
    assert dict(kinds) == {
        "chat": shape.sessions * shape.turns,
        "doc": shape.questions,
        "burst": shape.bursts * shape.burst_questions,
    }


def test_a_burst_asks_a_new_document_several_times_at_once() -> None:
    shape = Shape()
    requests = stream(WORDS, shape)
    documents = {r.prompt.rsplit(" ", shape.question_words)[0] for r in requests if r.kind == "doc"}
    bursts = defaultdict(list)
    for r in requests:
        if r.kind == "burst":
            bursts[r.key].append(r)
    assert len(bursts) == shape.bursts
    for asked in bursts.values():
        assert len(asked) == shape.burst_questions
        gaps = [b.at - a.at for a, b in itertools.pairwise(asked)]
        assert all(abs(g - shape.burst_gap_s) < 1e-9 for g in gaps)
        prefixes = {r.prompt.rsplit(" ", shape.question_words)[0] for r in asked}
        assert len(prefixes) == 1  # one document
        assert not prefixes & documents  # never asked about outside its burst
        assert len({r.prompt for r in asked}) == shape.burst_questions  # each its own question
        assert asked[0].at >= 0 and asked[-1].at < shape.seconds


def test_no_bursts_when_the_shape_says_none() -> None:
    assert not [r for r in stream(WORDS, Shape(bursts=0)) if r.kind == "burst"]
