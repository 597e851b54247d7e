"""LruPolicy on its own: order of use, candidates, bytes needed."""

from __future__ import annotations

from infinity.daemon.policy import EvictionPolicy, LruPolicy, default_policy


def keys(*names: str) -> list[tuple[str, str]]:
    return [("ns", n) for n in names]


def used(policy: LruPolicy, *names: str, nbytes: int = 10) -> None:
    for key in keys(*names):
        policy.touched(key, nbytes)


def test_the_least_recently_used_candidates_go_first_until_the_bytes_are_covered() -> None:
    policy = LruPolicy()
    used(policy, "a", "b", "c", "d")
    used(policy, "a")  # now the most recent
    candidates = {k: 10 for k in keys("a", "b", "c", "d")}
    assert policy.choose_victims(candidates, 15) == keys("b", "c")
    assert policy.choose_victims(candidates, 1) == keys("b")


def test_only_candidates_are_chosen_and_their_sizes_count() -> None:
    policy = LruPolicy()
    used(policy, "leased", "x", "y")
    assert policy.choose_victims({("ns", "x"): 100, ("ns", "y"): 100}, 50) == keys("x")
    assert policy.choose_victims(keys("y"), 50) == keys("y")  # any iterable of keys works


def test_forgotten_keys_are_not_chosen_until_used_again() -> None:
    policy = LruPolicy()
    used(policy, "a", "b")
    policy.forget(("ns", "a"))
    assert policy.choose_victims(set(keys("b")), 10) == keys("b")
    assert len(policy) == 1
    used(policy, "a")
    assert policy.choose_victims(set(keys("a", "b")), 20) == keys("b", "a")


def test_when_candidates_cannot_cover_the_need_all_of_them_are_offered() -> None:
    policy = LruPolicy()
    used(policy, "a")
    # "z" was never seen touched: offered after the ones in the recency order.
    assert policy.choose_victims({("ns", "z"): 10, ("ns", "a"): 10}, 1000) == keys("a", "z")


def test_the_default_policy_has_the_interface() -> None:
    policy: EvictionPolicy = default_policy()
    policy.touched(("ns", "a"), 1)
    assert policy.choose_victims([("ns", "a")], 1) == [("ns", "a")]
    policy.forget(("ns", "a"))
