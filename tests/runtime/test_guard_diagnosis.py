"""The group guard's diagnosis on its own (runtime.guard_diagnosis over runtime.guard_protocol's records): the
ranks named missing are the root causes, followed through the wait-for chain, without processes or threads."""
from __future__ import annotations

import json

from het_plugin.runtime.guard_diagnosis import Diagnosis
from het_plugin.runtime.guard_protocol import GuardKeys


class Store:
    """A store's get/check/set/add; the ranks in ``alive`` beat once between any two reads of their beat."""

    def __init__(self, alive=()):
        self.data: dict[str, bytes] = {}
        self.alive = set(alive)

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        value = self.data[key]
        rank = key.rsplit("/", 1)[-1]
        if "/beat/" in key and rank.isdigit() and int(rank) in self.alive:
            self.data[key] = str(int(value) + 1).encode()
        return value

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])


def test_a_waiting_rank_is_followed_to_the_rank_it_waits_for():
    keys = GuardKeys("p", 5)
    store = Store(alive={1, 4})
    keys.set_at(store, 1, 3, "tp", [1, 3], "creating")       # rank 1 waits in group #3 for rank 3
    keys.add_beat(store, 1)
    keys.set_at(store, 4, 1, "dp", [0, 4], "done")           # rank 4 is alive, past this phase
    keys.add_beat(store, 4)
    keys.publish_abort(store, 2, json.dumps({"message": "m", "missing": [3], "cause": "rank 3 vanished"}))
    keys.add_beat(store, 0)                                  # rank 0 (the one describing) beats; rank 3 never
    diagnosis = Diagnosis(keys, rank=0, world_size=5, what="the test's groups", interval=0.001)
    missing, details = diagnosis.describe(store, [1, 2, 4], n=2)
    assert missing == [3, 4]
    clauses = details.split("; ")
    assert clauses[0] == ("rank 1 is alive but waits at group #3 (tp) of the test's groups, ranks 1,3 for rank(s) 3")
    assert clauses[1] == "rank 2 gave up (rank 3 vanished)"
    assert clauses[2].startswith("rank 4 is alive but still at group #1 (dp)")
    assert clauses[3].startswith("rank 3 never started group creation")


def test_a_rank_waiting_in_the_same_group_arrived_and_a_silent_one_is_stale():
    keys = GuardKeys("p", 3)
    store = Store(alive={1})
    keys.set_at(store, 1, 2, None, [0, 1, 2], "creating")
    keys.add_beat(store, 1)
    keys.set_at(store, 2, 1, None, [0, 2], "creating")
    keys.add_beat(store, 2)                                   # beat once, then silent
    diagnosis = Diagnosis(keys, rank=0, world_size=3, what="w", interval=0.001)
    missing, details = diagnosis.describe(store, [1, 2], n=2)
    assert missing == [2]
    assert details.startswith("rank 2 stopped responding, last at group #1 of w, ranks 0,2")
