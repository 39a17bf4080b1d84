"""The trainer's side of a code test (judge.py), in this process: what it computes itself and what it asks
the jail for, the values it reads back from the jail, and the bounds on both. Python's own `eval` is the
independent reference. The jail's side is tests/test_sandbox.py."""
import json
import re
import time
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

import judge
import sandbox
from judge import read_value, split_test


def parts(test):
    return split_test(test)[1]


def verdict(test, values):
    """judge's verdict on `test` given the jail's value of each part (a list, in order)."""
    expr, _ = split_test(test)
    try:
        return bool(judge.judge(expr, dict(enumerate(values))))
    except Exception:   # as run_tests: whatever the expression raises fails the test
        return False


# the expected sides the issue names, which the jail computed: each is the trainer's now
EXPECTED = ["list(range(4))", "dict(a=2, b=1)", "pow(2, 10)", "' '.join(['a', 'b'])", "divmod(7, 2)",
            "list(enumerate('ab', start=1))", "list(zip([1, 2], 'ab'))", "list(reversed([1, 2, 3]))",
            "list(map(str, [1, 2]))", "list(filter(None, [0, 1, 2]))", "sorted(['b', 'A'], key=str.lower)",
            "'abc'.upper()", "math.comb(5, 2)", "max([3, 1], key=abs)", "{'a': 1}.get('a')"]


@pytest.mark.parametrize("expected", EXPECTED)
def test_only_the_completions_own_definitions_go_to_the_jail(expected):
    """`range(4)`, `dict(a=2, b=1)`, `pow(2, 10)`, `' '.join([...])` and the like were sent to the jail, where a
    completion rebinding `range` or forging the value chose the expected side. Now the jail is asked only
    for `f(1)`, and the trainer computes the rest as Python does."""
    test = f"assert f(1) == {expected}"
    assert parts(test) == ["f(1)"]
    right = eval(expected, {"math": __import__("math")})
    assert verdict(test, [right]) and not verdict(test, [[right]])


def test_a_builtin_given_the_completions_function_is_the_jails_whole():
    """map, filter, sorted's key and isinstance's class are functions the builtin calls: given the
    completion's, the whole call is the jail's, whose value comes back materialised."""
    assert parts("assert list(map(f, [1, 2])) == [2, 3]") == ["map(f, [1, 2])"]
    assert parts("assert sorted(xs(), key=g) == [1]") == ["sorted(xs(), key=g)"]
    assert parts("assert isinstance(f(), Point)") == ["isinstance(f(), Point)"]
    assert parts("assert isinstance(f(), (list, tuple))") == ["f()"]
    assert parts("assert Solution().f(g(2)) == 3") == ["Solution().f(g(2))"]
    # a module in the completion's inputs: they are the completion's to choose anyway
    assert parts("assert f(math.pi, os.sep) == 1") == ["f(math.pi, os.sep)"]


@pytest.mark.parametrize("test,why", [
    ("assert sorted([3, 1]) == [1, 3]", "names nothing of the completion's"),
    ("assert collections.Counter(f()) == {}", "collections.Counter is a module's"),
    ("assert np.allclose(f(), [1.0])", "np.allclose is a module's"),
    ("assert math.perm(5, 2) == f()", "math.perm is not among"),
    ("assert f() == '{}'.format(3)", ".format() is not a method the trainer calls"),
    ("assert f() == [x * 2 for x in range(3)]", "ListComp outside a call into the completion"),
    ("assert all(map(lambda x: x > 0, f()))", "as the function of map()"),
    # a builtin given as a value ([range]) would be called raw, unbounded, by the map given to this map
    ("assert f() == list(map(map, [range], [[10]]))", "map as the function of map()"),
    ("assert f() == f'{3}'", "JoinedStr outside a call into the completion"),
    ("assert f() == {**g()}", "Dict outside a call into the completion"),
    ("assert f() == max(*g())", "*args or **kwargs"),
    ("x = f(1)", "not an assert"),
    # nested deeper than judge() can follow: ast's own recursion gave up at 3000, judge's at 600
    ("assert f(1) == " + "+".join(["1"] * 3000), "nested more than 100 deep"),
    ("assert f(1) == " + "+".join(["1"] * 600), "nested more than 100 deep"),
    ("assert f(1) == " + "-" * 200 + "1", "nested more than 100 deep"),
])
def test_what_the_trainer_cannot_judge_is_refused_with_its_reason(test, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        split_test(test)


def test_a_test_nested_within_the_bound_is_judged():
    assert verdict("assert f(1) == " + "+".join(["1"] * 90), [90])
    assert not verdict("assert f(1) == " + "+".join(["1"] * 90), [89])


# the trainer's expected sides: builtins and methods of the allow-list over small constants, nested
constants = st.one_of(st.integers(-20, 20), st.text("abcAB ,", max_size=5),
                      st.lists(st.integers(-5, 5), max_size=4)).map(repr)
unary = ["abs({})", "len(str({}))", "str({})", "bool({})", "({}) * 2", "({}) + ({})"]
iterable = ["list(range({}))", "sorted({})", "list(reversed({}))", "list(enumerate({}))", "list(zip({}, {}))",
            "list(map(str, {}))", "list(filter(None, {}))", "set({})", "tuple({})", "sum({})", "max({}, default=0)",
            "' '.join(map(str, {}))", "dict(enumerate({}))", "len({})", "sorted({}, key=abs)"]


@st.composite
def expected_sides(draw, depth=2):
    leaf = draw(constants)
    if depth == 0 or draw(st.booleans()):
        return leaf
    inner = draw(expected_sides(depth=depth - 1))
    shape = draw(st.sampled_from(unary + iterable + ["pow({}, 2)", "divmod({}, 3)", "({}) == ({})"]))
    return shape.replace("{}", inner)


@settings(max_examples=300, deadline=None, database=None)
@given(expected=expected_sides(), value=st.one_of(st.integers(-3, 3), st.text("ab", max_size=2)))
def test_the_trainers_expected_side_is_pythons(expected, value):
    """Any expected side built from the allow-list: the trainer computes it (the jail is asked for f(1)
    alone), and its verdict on a value of f(1) is Python's verdict on the same assert."""
    try:
        right = eval(expected, {})
    except Exception:   # Python raises here: then so does the trainer, and the test fails
        right = None
    test = f"assert f(1) == ({expected})"
    assert parts(test) == ["f(1)"]
    for candidate in (value, right):
        try:
            python = bool(eval(test.removeprefix("assert "), {"f": lambda _: candidate}))
        except Exception:
            python = False
        assert verdict(test, [candidate]) == python, (test, candidate)


def test_rebinding_a_builtin_changes_nothing_of_the_expected_side():
    """The trainer's names are Python's builtins whatever the completion binds to them: its `range` is
    never called, so a test comparing with `list(range(4))` needs the completion's f(4) to be [0, 1, 2, 3]."""
    assert verdict("assert f(4) == list(range(4))", [[0, 1, 2, 3]])
    assert not verdict("assert f(4) == list(range(4))", [[9]])


# ----------------------------------------------------------------------- bounds on the trainer's own work

def refused_fast(expression, values):
    """judge on `expression` refuses (ValueError) -> (CPU seconds, peak bytes) it took."""
    expr, _ = split_test(f"assert {expression}")
    tracemalloc.start()
    cpu = time.process_time()
    try:
        with pytest.raises(ValueError, match="too big"):
            judge.judge(expr, dict(enumerate(values)))
        return time.process_time() - cpu, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("expression,values", [
    # just under the old cap of a power: 0.5-0.7 s of CPython's Karatsuba a test
    ("7 ** e() > 0", [8 * sandbox.OUTPUT_CAP // 3 - 1]),
    ("pow(7, e()) > 0", [judge.INT_BITS]),
    ("1 << e() > 0", [judge.INT_BITS + 1]),
    ("n() * n() > 0", [1 << (judge.INT_BITS // 2 + 8)] * 2),
    ("pow(3, e(), m()) > 0", [1 << 2000, 1 << 2000]),
    ("list(range(n())) == []", [10 ** 9]),
    ("len(range(n())) > 0", [10 ** 20]),   # more items than len() can count
    ("sum(range(n())) == 0", [10 ** 12]),
    ("('-' * 1000).join(f()) == ''", [["a"] * 50_000]),
    ("'x'.center(n()) == ''", [10 ** 9]),
    ("('a' * 1000).replace('a', s()) == ''", ["b" * 10_000]),
    ("round(5, n()) == 0", [-10 ** 9]),
    ("math.factorial(n()) > 0", [10 ** 6]),
    ("math.prod([n()] * 8) > 0", [1 << (judge.INT_BITS // 4)]),
])
def test_the_trainer_refuses_to_build_huge_results(expression, values):
    """Each builds, from values a completion chose, an integer or a sequence past the trainer's bounds
    (judge.INT_BITS, RANGE_ITEMS, OUTPUT_CAP): refused before it is built, at little cost."""
    cpu, peak = refused_fast(expression, values)
    assert cpu < 0.05 and peak < 1 << 20, (cpu, peak)


def test_within_the_bounds_the_same_operations_compute():
    assert verdict("assert 7 ** e() % 10 == 3", [3]) and verdict("assert f() == list(range(1000))",
                                                                [list(range(1000))])
    assert verdict("assert f() == '-'.join(['a', 'b'])", ["a-b"])


def test_every_container_counts_not_only_commas():
    """0.99 MiB of nested lists without commas counted as 650 values, and json built 520,651 lists (+51 MiB)
    before they were refused. Each "[" counts as a container now: refused before json runs, in little
    memory."""
    chunk = "[" * 60 + "]" * 60
    text = '["list",' + ",".join([chunk] * ((1 << 20) // 121 - 1)) + "]"
    assert len(text) < 1 << 20 and text.count(",") < 10_000
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="too many values"):
            read_value(text, [judge.MAX_NODES])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    # strings still count nothing of what they hold
    assert read_value('["list","[[[,,,","]]"]', [4]) == ["[[[,,,", "]]"]


# ---------------------------------------------------------- values that Python compares by their items

PLAIN = {}
exec(sandbox.PLAIN, PLAIN)   # the jail's writer: run here, on values this test makes


def through_the_jail(value):
    """`value` as the jail writes it and the trainer reads it back."""
    return read_value(json.dumps(PLAIN["_plain"](value, judge.MAX_NODES)), [judge.MAX_NODES])


LAZY = {"generator": lambda xs: (x for x in xs), "map": lambda xs: map(abs, xs), "zip": lambda xs: zip(xs, xs),
        "filter": lambda xs: filter(None, xs), "enumerate": enumerate, "reversed": lambda xs: reversed(xs),
        "range": lambda xs: range(len(xs)), "range step": lambda xs: range(1, 3 * len(xs), 3),
        "dict keys": lambda xs: dict.fromkeys(xs).keys(), "dict values": lambda xs: dict(enumerate(xs)).values(),
        "dict items": lambda xs: dict(zip(xs, xs)).items()}


@settings(max_examples=100, deadline=None, database=None)
@given(xs=st.lists(st.integers(-50, 50), max_size=12), kind=st.sampled_from(sorted(LAZY)))
def test_lazy_values_come_back_as_python_compares_them(xs, kind):
    """A generator, map, filter, zip, range or dict view came back as no value at all (0 of 7 where Python
    gives 7 of 7). Now the jail writes its items (a range its bounds) and the trainer rebuilds the same kind
    of object: listing, sorting, counting, `in`, and ==/!= against lists, sets and ranges are Python's."""
    make = LAZY[kind]
    got = through_the_jail(make(xs))
    assert list(got) == list(make(xs))
    for other in (list(make(xs)), set(make(xs)) if kind != "dict values" else None, range(len(xs))):
        assert (through_the_jail(make(xs)) == other) == (make(xs) == other), (kind, other)
    if kind.startswith("range") or kind.startswith("dict keys"):
        assert len(through_the_jail(make(xs))) == len(make(xs))
    assert (3 in through_the_jail(make(xs))) == (3 in make(xs))


def test_an_endless_generator_has_no_value():
    import itertools
    with pytest.raises(ValueError):
        PLAIN["_plain"](itertools.count(), judge.MAX_NODES)
    assert through_the_jail(range(10 ** 6, 10 ** 6 + 3)) == range(10 ** 6, 10 ** 6 + 3)
    # a range the trainer would not build itself, and one with more items than len() can count
    for huge in (range(10 ** 9), range(10 ** 20), range(-10 ** 20, 10 ** 20, 7)):
        with pytest.raises(ValueError, match="too big"):
            through_the_jail(huge)
    assert through_the_jail(range(10 ** 20, 0, -10 ** 16)) == range(10 ** 20, 0, -10 ** 16)
