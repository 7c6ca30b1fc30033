"""The radix tree against a brute-force model of what each tenant has seen.

The model keeps, per tenant, every non-empty prefix it owns with the stamp of the last insert that
covered it. "Eviction never drops a prefix still within budget" is defined on it: after
``evict(budget)`` a tenant that held more than ``budget`` prefixes keeps exactly the ``budget``
most recent ones, ordered by stamp and, among equal stamps (one inserted path), shorter first; a
tenant within budget keeps everything.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pdrouter.policies.radix_tree import RadixTree, _Node


class Model:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {}
        self.clock = 0

    def insert(self, text: str, tenant: str) -> None:
        prefixes = self.held.setdefault(tenant, {})
        if not text:
            return
        self.clock += 1
        for i in range(1, len(text) + 1):
            prefixes[text[:i]] = self.clock

    def remove_tenant(self, tenant: str) -> None:
        self.held.pop(tenant, None)

    def evict(self, budget: int) -> int:
        removed = 0
        for prefixes in self.held.values():
            excess = len(prefixes) - budget
            if excess <= 0:
                continue
            oldest = sorted(prefixes.items(), key=lambda kv: (kv[1], -len(kv[0])))[:excess]
            for prefix, _ in oldest:
                del prefixes[prefix]
            removed += excess
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
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), texts, st.sampled_from(TENANTS)),
        st.tuples(st.just("insert"), texts, st.sampled_from(TENANTS)),
        st.tuples(st.just("remove"), st.sampled_from(TENANTS)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
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
    for op in operations:
        kind = op[0]
        if kind == "insert":
            text, tenant = op[1], op[2]
            assert isinstance(text, str) and isinstance(tenant, str)
            tree.insert(text, tenant)
            model.insert(text, tenant)
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
        tree._check_invariants()
        for tenant in TENANTS:
            assert tree_prefixes(tree, tenant) == model.held.get(tenant, {})
            assert tree.tenant_chars(tenant) == len(model.held.get(tenant, {}))
    # Every prefix of every probe answers like the model, for every eligibility.
    for probe in ["", "x", "xyzxyz", "zzzz", "yxy"]:
        for eligible in [None, {"a"}, {"b", "c"}, set()]:
            assert tree.match(probe, eligible) == model.match(probe, eligible)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(texts, st.sampled_from(TENANTS)), max_size=30),
    st.integers(0, 15),
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
        assert tree.tenant_chars(tenant) == len(kept) <= budget
        held = before[tenant]
        if len(held) <= budget:
            assert kept == held  # within budget: untouched
            continue
        assert len(kept) == budget  # over budget: trimmed exactly to it, not below
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
    st.lists(st.tuples(texts, st.sampled_from(TENANTS)), max_size=30),
    st.integers(0, 15),
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
    assert tree.tenant_chars("a") == 11 and tree.tenant_chars("b") == 11
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
