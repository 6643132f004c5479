"""Session affinity over generation replicas (rlframe/workers/rollout/affinity.py): a conversation's later
turns land in its first turn's replica's chunk of the call's cut, while each replica keeps its share."""

from rlframe.workers.rollout.affinity import ReplicaAffinity


def chunks(keys, perm, replicas):
    """Which replica each key's row runs on: row k of the ordered call on replica k // ceil(n / replicas)."""
    per = -(-len(keys) // replicas)
    return {keys[i]: k // per for k, i in enumerate(perm)}


def test_first_turns_cut_in_order_then_turns_follow_their_replica():
    aff = ReplicaAffinity()
    first = list("abcdefgh")
    perm = aff.order(first, 2)
    assert perm == list(range(8))  # a first call is the plain cut: a prompt's adjacent samples stay together
    home = chunks(first, perm, 2)
    later = list("hgbc")  # finished: a d e f; the survivors come back in another order
    perm = aff.order(later, 2)
    assert sorted(perm) == [0, 1, 2, 3]
    assert chunks(later, perm, 2) == {k: home[k] for k in later}  # 2 of replica 0's, 2 of replica 1's: all stay
    assert (aff.kept, aff.moved) == (4, 0)


def test_a_replica_with_more_than_its_share_sends_the_overflow_elsewhere():
    aff = ReplicaAffinity()
    aff.order(list("abcdef"), 3)  # a b on 0, c d on 1, e f on 2
    later = list("abce")  # replica 0 has two of four rows, its share of a 4-row call over 3 is 2 (rooms 2, 2, 0)
    got = chunks(later, aff.order(later, 3), 3)
    assert got == {"a": 0, "b": 0, "c": 1, "e": 1}  # e's replica gets only padding in this call: e moves to 1
    assert (aff.kept, aff.moved) == (3, 1)
    assert aff.home["e"] == 1  # and stays there
    assert chunks(list("ec"), aff.order(list("ec"), 3), 3) == {"e": 1, "c": 0}  # both at home 1, room for one
    assert (aff.kept, aff.moved) == (4, 2)


def test_one_replica_or_one_row_keeps_the_order():
    aff = ReplicaAffinity()
    assert aff.order(list("abc"), 1) == [0, 1, 2]
    assert aff.order(["x"], 4) == [0]
