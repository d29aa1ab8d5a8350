"""The seam between model, providers, runtime and backends: RoutedExperts holds
one layer's answer (host ids, unique ids once, weights taken one expert at a time), and a share of
it (`with_ids`) keeps every expert and the answer's waits while naming other rows."""

from __future__ import annotations

import torch

from streamrt.expert_weights import RoutedExperts, as_routed
from streamrt.parallel.shard import Remote, ShardExperts


class _Counting(RoutedExperts):
    """An answer whose experts 5 and 9 are still copying; counts what was taken."""

    def __init__(self, views, host_ids):
        super().__init__(views, host_ids, layer=3)
        self.taken: list[int] = []

    def take(self, e):
        self.taken.append(e)
        return super().take(e)

    def pending(self, e):
        return e in (5, 9)


def test_unique_once_missing_and_plain_mappings():
    ids = torch.tensor([[9, 2], [2, 5]])
    r = RoutedExperts({2: "w2", 5: "w5"}, ids)
    assert r.unique == [2, 5, 9] and r.missing() == [9] and r.has(2) and not r.has(9)
    assert not r.pending(2) and r.is_local(2) and r.take(5) == "w5"
    wrapped = as_routed({2: "w2", 5: "w5", 9: "w9"}, ids)  # a plain provider's dict
    assert isinstance(wrapped, RoutedExperts) and wrapped.unique == [2, 5, 9] and wrapped.missing() == []
    assert as_routed(r, r.host_ids) is r  # the answer for exactly its own ids is itself


def test_a_share_names_its_rows_and_keeps_the_answers_waits():
    whole = _Counting({2: "w2", 5: "w5", 9: "w9"}, torch.tensor([[9, 2], [2, 5]]))
    share = whole.with_ids(whole.host_ids[1:2])  # the second forward's row, as lockstep hands it
    assert share.unique == [2, 5] and share.missing() == [] and share.layer == 3
    assert share.pending(5) and not share.pending(2) and whole.taken == []  # asking takes nothing
    assert share.take(5) == "w5" and whole.taken == [5]  # taking goes through the answer (its waits)
    other = as_routed(whole, torch.tensor([[9]]))  # other ids than the answer's: a share for them
    assert other.unique == [9] and other.take(9) == "w9" and whole.taken == [5, 9]


def test_a_shard_answer_is_local_through_a_share():
    host = torch.tensor([[0, 1], [1, 2]])
    local = RoutedExperts({0: "w0", 2: "w2"}, torch.tensor([[0, 2]]), layer=4)
    shard = ShardExperts(local, {1: Remote(4, 1, rank=1)}, host, 4, [0, 1, 2])
    assert shard.unique == [0, 1, 2] and shard.missing() == []
    assert shard.is_local(0) and not shard.is_local(1) and shard.take(2) == "w2"
    share = shard.with_ids(host[1:])
    assert share.unique == [1, 2] and not share.is_local(1) and share.is_local(2)
    assert isinstance(share.take(1), Remote)
