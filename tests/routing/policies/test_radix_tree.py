"""The radix tree against a brute-force model of what each tenant has seen.

The model keeps, per tenant, every non-empty prefix it owns with the stamp of the last insert that
covered it; a prefix weighs the UTF-8 bytes of its last character, so a tenant's weight is the
bytes of text it owns. "Eviction never drops a prefix still within budget" is defined on it: after
``evict(budget)`` a tenant that held more than ``budget`` bytes drops its oldest prefixes, ordered
by stamp and, among equal stamps (one inserted path), longest first, until it holds at most
``budget``; a tenant within budget keeps everything. ``retract`` undoes one insert: the prefixes
it gave the tenant that no later insert stamped again.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pdrouter.routing.policies.radix_tree import Inserted, RadixTree, _Node


def weight(prefix: str) -> int:
    return len(prefix[-1].encode())


def weights(prefixes: Iterable[str]) -> int:
    return sum(weight(p) for p in prefixes)


class Model:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {}
        self.clock = 0

    def insert(self, text: str, tenant: str) -> tuple[int, int]:
        """The stamp and how many leading characters the tenant held already."""
        prefixes = self.held.setdefault(tenant, {})
        if not text:
            return self.clock, 0
        held = max(i for i in range(len(text) + 1) if i == 0 or text[:i] in prefixes)
        self.clock += 1
        for i in range(1, len(text) + 1):
            prefixes[text[:i]] = self.clock
        return self.clock, held

    def retract(self, text: str, tenant: str, stamp: int, held: int) -> int:
        prefixes = self.held.get(tenant)
        removed = 0
        for i in range(len(text), held, -1):
            if prefixes is None or text[:i] not in prefixes:
                continue  # evicted since
            if prefixes[text[:i]] != stamp:
                break  # stamped again since
            del prefixes[text[:i]]
            removed += weight(text[:i])
        return removed

    def remove_tenant(self, tenant: str) -> None:
        self.held.pop(tenant, None)

    def evict(self, budget: int) -> int:
        removed = 0
        for prefixes in self.held.values():
            excess = weights(prefixes) - budget
            oldest = sorted(prefixes.items(), key=lambda kv: (kv[1], -len(kv[0])))
            for prefix, _ in oldest:
                if excess <= 0:
                    break
                del prefixes[prefix]
                excess -= weight(prefix)
                removed += weight(prefix)
        return removed

    def match(self, text: str, eligible: Iterable[str] | None) -> tuple[int, str | None]:
        best: tuple[int, int, str | None] = (0, 0, None)
        for tenant in self.held if eligible is None else eligible:
            prefixes = self.held.get(tenant, {})
            length = max((i for i in range(1, len(text) + 1) if text[:i] in prefixes), default=0)
            if length:
                candidate = (length, prefixes[text[:length]], tenant)
                if candidate[:2] > best[:2]:
                    best = candidate
        return best[0], best[2]


def tree_prefixes(tree: RadixTree[str], tenant: str) -> dict[str, int]:
    out: dict[str, int] = {}
    stack: list[tuple[str, _Node[str]]] = [("", c) for c in tree._root.children.values()]
    while stack:
        path, node = stack.pop()
        if tenant not in node.stamps:
            continue
        for i in range(1, len(node.label) + 1):
            out[path + node.label[:i]] = node.stamps[tenant]
        stack.extend((path + node.label, c) for c in node.children.values())
    return out


TENANTS = ["a", "b", "c"]
texts = st.text(alphabet="xyz", max_size=10)
# One and two bytes a character, and four: the byte budget's cuts fall inside characters.
wide_texts = st.text(alphabet="xyé😀", max_size=10)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), texts | wide_texts, st.sampled_from(TENANTS)),
        st.tuples(st.just("insert"), texts, st.sampled_from(TENANTS)),
        st.tuples(st.just("remove"), st.sampled_from(TENANTS)),
        st.tuples(st.just("evict"), st.integers(0, 24)),
        st.tuples(st.just("retract"), st.integers(0, 40)),
        st.tuples(
            st.just("match"),
            texts,
            st.none() | st.sets(st.sampled_from(TENANTS)),
        ),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_tree_matches_brute_force_model(operations: list[tuple[object, ...]]) -> None:
    tree: RadixTree[str] = RadixTree()
    tree._garbage_slack = 0  # exercise the heap filtering that normally waits for 1024 entries
    model = Model()
    inserted: list[tuple[str, str, Inserted, tuple[int, int]]] = []
    for op in operations:
        kind = op[0]
        if kind == "insert":
            text, tenant = op[1], op[2]
            assert isinstance(text, str) and isinstance(tenant, str)
            mark = tree.insert(text, tenant)
            expected = model.insert(text, tenant)
            assert mark == expected
            inserted.append((text, tenant, mark, expected))
        elif kind == "retract":
            assert isinstance(op[1], int)
            if not inserted:
                continue
            text, tenant, mark, (stamp, held) = inserted[op[1] % len(inserted)]
            assert tree.retract(text, tenant, mark) == model.retract(text, tenant, stamp, held)
        elif kind == "remove":
            assert isinstance(op[1], str)
            tree.remove_tenant(op[1])
            model.remove_tenant(op[1])
        elif kind == "evict":
            assert isinstance(op[1], int)
            assert tree.evict(op[1]) == model.evict(op[1])
        else:
            text, eligible = op[1], op[2]
            assert isinstance(text, str)
            assert eligible is None or isinstance(eligible, set)
            assert tree.match(text, eligible) == model.match(text, eligible)
            if eligible is not None:  # the one walk that also gives match's answer
                assert tree.match_with_each(text, eligible)[1:] == model.match(text, eligible)
        tree._check_invariants()
        for tenant in TENANTS:
            assert tree_prefixes(tree, tenant) == model.held.get(tenant, {})
            assert tree.tenant_bytes(tenant) == weights(model.held.get(tenant, {}))
    # Every prefix of every probe answers like the model, for every eligibility.
    for probe in ["", "x", "xyzxyz", "zzzz", "yxy"]:
        for eligible in [None, {"a"}, {"b", "c"}, set()]:
            assert tree.match(probe, eligible) == model.match(probe, eligible)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(texts | wide_texts, st.sampled_from(TENANTS)), max_size=30),
    st.integers(0, 30),
)
def test_eviction_keeps_budget_and_most_recent_prefixes(
    inserts: list[tuple[str, str]], budget: int
) -> None:
    tree: RadixTree[str] = RadixTree()
    model = Model()
    for text, tenant in inserts:
        tree.insert(text, tenant)
        model.insert(text, tenant)
    before = {t: tree_prefixes(tree, t) for t in TENANTS}
    tree.evict(budget)
    tree._check_invariants()
    for tenant in TENANTS:
        kept = tree_prefixes(tree, tenant)
        assert tree.tenant_bytes(tenant) == weights(kept) <= budget
        held = before[tenant]
        if weights(held) <= budget:
            assert kept == held  # within budget: untouched
            continue
        # over budget: trimmed to it, not below but for part of a character cut through
        assert weights(kept) > budget - 4
        # Every kept prefix is at least as recent as every dropped one.
        dropped = held.keys() - kept.keys()
        if kept and dropped:
            assert min((s, -len(p)) for p, s in kept.items()) > max(
                (held[p], -len(p)) for p in dropped
            )
        # What is kept is still a set of prefixes of the tenant's strings (closed under prefix).
        assert all(p[:i] in kept for p in kept for i in range(1, len(p)))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(texts | wide_texts, st.sampled_from(TENANTS)), max_size=30),
    st.integers(0, 30),
    st.integers(1, 4),
)
def test_eviction_in_slices_ends_where_one_eviction_does(
    inserts: list[tuple[str, str]], budget: int, slice_steps: int
) -> None:
    whole: RadixTree[str] = RadixTree()
    sliced: RadixTree[str] = RadixTree()
    for text, tenant in inserts:
        whole.insert(text, tenant)
        sliced.insert(text, tenant)
    whole.evict(budget)
    calls = 0
    while sliced.over_budget(budget):
        sliced.evict(budget, max_steps=slice_steps)
        sliced._check_invariants()
        calls += 1
        assert calls < 1000, "every slice makes progress"
    assert not whole.over_budget(budget)
    for tenant in TENANTS:
        assert tree_prefixes(sliced, tenant) == tree_prefixes(whole, tenant)


def test_match_prefers_longest_then_most_recent() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "b")
    assert tree.match("abcdeq") == (5, "a")
    assert tree.match("abcxy") == (5, "b")
    assert tree.match("abc") == (3, "b")  # both own "abc"; b used it last
    tree.insert("abcdef", "a")
    assert tree.match("abc") == (3, "a")
    assert tree.match("abq", eligible={"b"}) == (2, "b")
    assert tree.match("q") == (0, None)
    assert tree.match("abc", eligible=set()) == (0, None)
    assert tree.match("") == (0, None)


def test_remove_tenant_and_counts() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.tenant_bytes("a") == 11 and tree.tenant_bytes("b") == 11
    tree.remove_tenant("a")
    assert tree.tenants() == {"b": 11}
    assert tree.match("hello world") == (6, "b")
    tree._check_invariants()
    # Compaction merged the split node back into one edge.
    assert [c.label for c in tree._root.children.values()] == ["hello there"]
    tree.remove_tenant("a")  # unknown: ignored


def test_long_prompts_are_linear() -> None:
    # A smoke test for the O(len) path: 32 KB prompts sharing a 16 KB prefix.
    tree: RadixTree[int] = RadixTree()
    base = "s" * 16_384
    for i in range(200):
        tree.insert(base + f"{i:05d}" * 3_000, i % 4)
    matched, tenant = tree.match(base + "00042" * 3_000)
    assert matched == 16_384 + 15_000 and tenant == 42 % 4
    tree.evict(100_000)
    tree._check_invariants()
    assert all(n <= 100_000 for n in tree.tenants().values())


def test_counts_are_bytes() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("日本語", "a")  # 3 characters, 9 bytes
    tree.insert("日本", "b")
    assert tree.tenants() == {"a": 9, "b": 6}
    tree.evict(4)  # a cut inside a character drops it whole: 3 bytes are kept, not 4
    assert tree.tenants() == {"a": 3, "b": 3}
    assert tree.match("日本語") == (1, "b")
    tree._check_invariants()


def test_retract_gives_back_only_what_the_insert_gave() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("system: be brief", "a")
    mark = tree.insert("system: be brief. question?", "a")
    tree.insert("system: be brief. question?", "b")
    assert mark[1] == len("system: be brief")
    assert tree.retract("system: be brief. question?", "a", mark) == len(". question?")
    assert tree.tenants() == {"a": 16, "b": 27}
    assert tree.match("system: be brief. question?", {"a"}) == (16, "a")
    tree._check_invariants()
    again = tree.insert("x y z", "a")
    tree.insert("x y", "a")  # a later insert re-stamped "x y": it stays
    assert tree.retract("x y z", "a", again) == 2
    assert tree.match("x y z", {"a"}) == (3, "a")
    tree._check_invariants()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(texts | wide_texts, st.sampled_from(TENANTS)), max_size=20),
    texts | wide_texts,
    st.sampled_from(TENANTS),
    st.integers(0, 30),
)
def test_retracting_the_last_insert_restores_what_the_tenant_owned(
    history: list[tuple[str, str]], text: str, tenant: str, budget: int
) -> None:
    tree: RadixTree[str] = RadixTree()
    for before, owner in history:
        tree.insert(before, owner)
    tree.evict(budget)
    owned = {t: tree_prefixes(tree, t) for t in TENANTS}
    counts = tree.tenants()
    mark = tree.insert(text, tenant)
    tree.retract(text, tenant, mark)
    tree._check_invariants()
    after = {t: tree_prefixes(tree, t) for t in TENANTS}
    # The same prefixes as before (the ones held before keep the insert's newer stamp).
    assert {t: set(p) for t, p in after.items()} == {t: set(p) for t, p in owned.items()}
    assert {t: tree.tenant_bytes(t) for t in TENANTS} == {t: counts.get(t, 0) for t in TENANTS}
