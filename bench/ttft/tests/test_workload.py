"""The workload generator: seeded, shared prefixes where they should be, a working set that can exceed a pool."""

import pytest

from harness import workload as wl

CFG = wl.WorkloadConfig(seed=3, vocab=1000, page_size=16, sys_len=32, docs=2, doc_len=64, doc_prob=1.0,
                     sessions=5, turns=3, user_len=16, answer_len=8)


def same_seed_gives_the_same_stream_and_another_seed_does_not():
    a, b = wl.generate(CFG), wl.generate(CFG)
    assert [(r.session, r.turn, r.tokens) for r in a] == [(r.session, r.turn, r.tokens) for r in b]
    c = wl.generate(wl.WorkloadConfig(**{**CFG.__dict__, "seed": 4}))
    assert [r.tokens for r in a] != [r.tokens for r in c]


def each_turn_resends_the_whole_previous_turn_plus_its_answer():
    reqs = wl.generate(CFG)
    assert len(reqs) == CFG.sessions * CFG.turns
    by = {}
    for r in reqs:
        by.setdefault(r.session, []).append(r)
    for turns in by.values():
        assert [t.turn for t in turns] == list(range(CFG.turns))
        for prev, cur in zip(turns, turns[1:]):
            assert cur.tokens[:len(prev.tokens)] == prev.tokens
            assert len(cur.tokens) == len(prev.tokens) + CFG.answer_len + CFG.user_len


def sessions_share_the_system_prompt_and_their_document():
    reqs = [r for r in wl.generate(CFG) if r.turn == 0]
    sys_ = reqs[0].tokens[:CFG.sys_len]
    assert all(r.tokens[:CFG.sys_len] == sys_ for r in reqs)
    docs = {}
    for r in reqs:
        docs.setdefault(r.doc, set()).add(tuple(r.tokens[CFG.sys_len:CFG.sys_len + CFG.doc_len]))
    assert all(len(v) == 1 for v in docs.values())
    # Sessions are interleaved, not served one after another.
    order = [r.session for r in wl.generate(CFG)]
    assert order != sorted(order)


def page_digests_are_chained_and_only_cover_full_pages():
    t = list(range(50))
    d = wl.page_digests(t, 16)
    assert len(d) == 3 and all(len(x) == 32 for x in d)
    assert wl.page_digests(t[:48], 16) == d
    t2 = [7] + t[1:]
    assert all(x != y for x, y in zip(wl.page_digests(t2, 16), d))  # a change in page 0 changes every later digest
    assert wl.hint_hash(d[0]) == int.from_bytes(d[0][:8], "big")


def stats_count_the_distinct_working_set():
    reqs = wl.generate(CFG)
    s = wl.stats(reqs, 16)
    distinct = set()
    for r in reqs:
        distinct.update(wl.page_digests(r.tokens, 16))
    assert s["distinct_pages"] == len(distinct)
    assert s["requests"] == len(reqs) and s["prompt_len_max"] == max(len(r.tokens) for r in reqs)


@pytest.mark.parametrize("field,value", [("sessions", 0), ("doc_prob", 1.5), ("user_len", 0)])
def bad_configs_are_refused_with_the_field_named(field, value):
    with pytest.raises(ValueError, match=field):
        wl.generate(wl.WorkloadConfig(**{**CFG.__dict__, field: value}))
