"""The code reward's verdict, computed by the trainer: each unit test `assert E` is parsed (split_test); the
parts of E that name the completion's own definitions (`f(x, k=[1])`, `X`, `obj.m()`) are all the jail
(sandbox.py) computes, and it writes back their values as tagged JSON, read here within bounds
(read_value); the rest of E, the expected side whole, is evaluated here (judge) with an allow-list: Python's
pure builtins (BUILTINS), math's functions (MATH, and isclose alone) and pure methods (METHODS) on values the
trainer holds, each bounded where a value the completion chose could make its result huge. A test that
needs anything else (a module's function, a comprehension, a lambda), names nothing of the completion's or
is nested deeper than TEST_DEPTH is refused when the task loads (rewards.check_tests), in one line. It
imports no project module."""
import ast
import builtins
import json
import math
import operator
import re
import sys

# the most bytes of values read from one completion: what the jail may write (sandbox.read_output)
OUTPUT_CAP = 1 << 20
# the parse of the jail's values: at most this many values and containers in one completion's, nested
# this deep, and this many distinct values sharing one hash (more make a set or dict quadratic)
MAX_NODES, MAX_DEPTH, MAX_COLLISIONS = 50_000, 64, 8
# a test's expression nested at most this deep: judge() takes a few frames of the recursion limit a level
TEST_DEPTH = 100
# the trainer's own results: integers of at most INT_BITS bits (CPython multiplies big integers in
# Karatsuba time: a 1 MiB power cost 0.5 s), ranges of at most RANGE_ITEMS items (a set of them: 10 MiB)
INT_BITS, RANGE_ITEMS = 1 << 16, 1 << 16
# what tests call that the trainer computes, by name; see CALLS for the bounded ones
BUILTINS = ("abs", "all", "any", "bool", "chr", "dict", "divmod", "enumerate", "filter", "float",
            "frozenset", "int", "isinstance", "len", "list", "map", "max", "min", "ord", "pow", "range",
            "reversed", "round", "set", "sorted", "str", "sum", "tuple", "type", "zip")
MATH = {"isclose", "isnan", "isinf", "isfinite", "fabs", "sqrt", "floor", "ceil", "trunc", "exp", "log",
        "log2", "log10", "hypot", "gcd", "lcm", "isqrt", "comb", "factorial", "prod", "pi", "e", "tau", "inf",
        "nan"}
_STR = {"capitalize", "casefold", "center", "count", "encode", "endswith", "find", "index", "isalnum",
        "isalpha", "isascii", "isdecimal", "isdigit", "islower", "isnumeric", "isspace", "istitle",
        "isupper", "join", "ljust", "lower", "lstrip", "partition", "removeprefix", "removesuffix",
        "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip", "split", "splitlines",
        "startswith", "strip", "swapcase", "title", "upper", "zfill"}
_SET = {"copy", "difference", "intersection", "isdisjoint", "issubset", "issuperset",
        "symmetric_difference", "union"}
# methods called on the trainer's own values (a constant of the test, or what a builtin made of one),
# or through the type (`key=str.lower`); a method of a value of the completion's runs in the jail
METHODS = {str: _STR, bytes: {"count", "decode", "endswith", "find", "hex", "index", "startswith"},
           list: {"copy", "count", "index"}, tuple: {"count", "index"},
           dict: {"copy", "get", "items", "keys", "values"}, set: _SET, frozenset: _SET,
           int: {"bit_count", "bit_length"}, float: {"is_integer"}}
TYPES = {kind.__name__: kind for kind in METHODS if kind.__name__ in BUILTINS}
# the arguments of these builtins that are functions the trainer calls: the builtins' own names (or
# None, or `str.lower`); where one is the completion's, the whole call is the jail's
FUNCTION_ARGS = {"map": (0, None), "filter": (0, None), "sorted": (None, "key"), "max": (None, "key"),
                 "min": (None, "key"), "isinstance": (1, None)}
# a name a test uses as a module (`collections.Counter(...)`): in the test's namespace it is whatever the
# completion bound to it, so the trainer can neither compute it nor trust the jail's value of it
MODULES = set(sys.stdlib_module_names) | {"np", "numpy", "pd", "pandas", "scipy", "sympy", "torch"}
# nodes the trainer evaluates (their children may still be the jail's)
OWN = (ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.IfExp, ast.Tuple, ast.List,
       ast.Set, ast.Dict, ast.Subscript, ast.Slice)
CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
       ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
       ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
          ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
          ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.MatMult: operator.matmul}
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
STRING = re.compile(r'"[^"]*"')   # a JSON string once its escaped backslashes and quotes are gone


def hashed(kind, items):
    """kind(items) for a set, frozenset or dict (items: its keys, or (key, value) pairs for a dict), once
    no more than MAX_COLLISIONS distinct keys share a hash: keys of one hash (multiples of 2**61 - 1, or
    tuples built to collide) make each insertion compare with all before it. ValueError if they do."""
    items, seen = list(items), {}
    for key in (pair[0] for pair in items) if kind is dict else items:
        same = seen.setdefault(hash(key), [])
        if not any(key == other for other in same):
            same.append(key)
            if len(same) > MAX_COLLISIONS:
                raise ValueError("too many values share one hash")
    return kind(items)


def too_big(message):
    raise ValueError(f"too big: {message}")


def binary(op: ast.operator, a, b):
    """a op b, refused (ValueError) where it would be huge: a sequence repeated past OUTPUT_CAP items or
    characters, an integer product, power or shift past INT_BITS bits, or formatting a string (its width
    is the completion's)."""
    ints = type(a) in (int, bool) and type(b) in (int, bool)
    if isinstance(op, ast.Mult):
        for x, y in ((a, b), (b, a)):
            if isinstance(x, (str, bytes, list, tuple)) and isinstance(y, int) and len(x) * y > OUTPUT_CAP:
                too_big("a sequence repeated")
        if ints and a.bit_length() + b.bit_length() > INT_BITS:
            too_big("a product")
    if ints and isinstance(op, ast.Pow) and abs(a) > 1 and b * a.bit_length() > INT_BITS:
        too_big("a power")
    if ints and isinstance(op, ast.LShift) and a and a.bit_length() + b > INT_BITS:
        too_big("a shift")
    if isinstance(op, ast.Mod) and isinstance(a, (str, bytes)):
        raise ValueError("no % formatting")
    return BINARY[type(op)](a, b)


def numeric_sum(items, start=0):
    """sum() of numbers only: summing lists (sum(xs, [])) copies the total so far at each item."""
    if not isinstance(start, (int, float, complex)):
        raise ValueError("sum() of numbers only")
    return sum(items, start)


def bounded_range(*args):
    items = range(*args)
    # what lies past the first RANGE_ITEMS items, not len(), which raises OverflowError past sys.maxsize
    if items[RANGE_ITEMS:]:
        too_big(f"a range of more than {RANGE_ITEMS} items")
    return items


def bounded_pow(base, exp, mod=None):
    if mod is None:
        return binary(ast.Pow(), base, exp)
    if max(abs(exp), abs(mod)).bit_length() > 1024:
        too_big("a modular power")
    return pow(base, exp, mod)


def bounded_round(number, ndigits=None):
    if isinstance(ndigits, int) and abs(ndigits) > 20_000:
        too_big("round() to that many digits")
    return round(number, ndigits)


def dict_of(*args, **kwargs):
    """dict(), its keys through `hashed`."""
    if len(args) > 1:
        raise TypeError("dict expected at most 1 argument")
    pairs = [tuple(p) for p in (args[0].items() if isinstance(args[0], dict) else args[0])] if args else []
    return hashed(dict, pairs + list(kwargs.items()))


def small_int(*ints, limit=4096):
    if any(not isinstance(n, int) or abs(n) > limit for n in ints):
        too_big(f"math of integers over {limit}")


def bounded_prod(items, *, start=1):
    total = start
    for x in items:
        total = binary(ast.Mult(), total, x)
    return total


def bounded_lcm(*ints):
    if sum(abs(n).bit_length() for n in ints if isinstance(n, int)) > INT_BITS:
        too_big("an lcm")
    return math.lcm(*ints)


# and `isclose` alone (after `from math import isclose`) is math's: were it the completion's, the jail would
# get the expected value with the call (`isclose(f(1), 0.5)`) and say True whatever f(1) is
CALLS = {**{name: getattr(builtins, name) for name in BUILTINS},
         "set": lambda items=(): hashed(set, items), "frozenset": lambda items=(): hashed(frozenset, items),
         "dict": dict_of, "sum": numeric_sum, "range": bounded_range, "pow": bounded_pow,
         "round": bounded_round, "type": lambda value: type(value), "isclose": math.isclose}
MATH_CALLS = {**{name: getattr(math, name) for name in MATH},
              "factorial": lambda n: small_int(n) or math.factorial(n),
              "comb": lambda n, k: small_int(n, k) or math.comb(n, k), "prod": bounded_prod,
              "lcm": bounded_lcm}


def call_method(receiver, name, args, kwargs):
    """receiver.name(*args, **kwargs) for a method of METHODS, refused (ValueError) where its result would
    pass OUTPUT_CAP characters: padding to a width, replace, join."""
    if name not in METHODS.get(type(receiver), ()):
        raise ValueError(f"{type(receiver).__name__}.{name}() is not a method the trainer calls")
    if name in ("center", "ljust", "rjust", "zfill"):
        width = kwargs.get("width", args[0] if args else 0)
        if isinstance(width, int) and width > OUTPUT_CAP:
            too_big("a string padded")
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        grown = (len(args[1]) - len(args[0])) * receiver.count(args[0])
        if len(receiver) + grown > OUTPUT_CAP:
            too_big("a string replaced")
    if name == "join" and args:
        args = (list(args[0]), *args[1:])
        length = sum(len(x) for x in args[0] if isinstance(x, str)) + len(receiver) * len(args[0])
        if length > OUTPUT_CAP:
            too_big("a string joined")
    return getattr(receiver, name)(*args, **kwargs)


def unbound(kind, name):
    """`str.lower` as the trainer calls it (map, sorted's key): call_method on a value of that type."""
    def method(receiver, *args, **kwargs):
        if type(receiver) is not kind:
            raise TypeError(f"{kind.__name__}.{name} of a {type(receiver).__name__}")
        return call_method(receiver, name, args, kwargs)
    return method


def split_test(test: str) -> tuple[ast.expr, list[str]]:
    """'assert E' -> (E, the parts of E the jail computes), or ValueError saying why the trainer cannot
    judge it. A part is a maximal subexpression that names the completion's own definitions: a name that
    is none of CALLS (`X`, `f(x, k=[1])`, the `f(1)` of `f(1)[0]`), an attribute or method of
    one (`obj.m()`, `Solution().f(g(2))`), or a builtin given one as its function (`map(f, xs)`,
    `isinstance(x, Point)`). Everything else is the trainer's (judge). Each part is marked on its node
    (`node.jail`, its index). Refused: a test that is no assert, names nothing of the completion's, or
    needs a module (`collections.Counter(...)`, `math.x` outside MATH), a comprehension, a lambda, `*args`
    or a method outside METHODS on the trainer's side, or is nested deeper than TEST_DEPTH."""
    # ast.parse builds its tree recursively (a test nested a thousand deep exhausts the recursion limit),
    # and judge() too: what is left below TEST_DEPTH levels, counted level by level, is refused
    try:
        body = level = ast.parse(test).body
        for _ in range(TEST_DEPTH):
            level = [child for node in level for child in ast.iter_child_nodes(node)]
    except RecursionError:
        level = [test]
    if level:
        raise ValueError(f"nested more than {TEST_DEPTH} deep: the trainer cannot judge {test[:100]!r}...")
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise ValueError(f"not an assert: {test!r}")
    parts = []

    def refuse(why):
        raise ValueError(f"{why}: the trainer cannot judge {test!r}")

    def names_completion(node):
        return bool(free_names(node) - {*CALLS, "math"})

    def jail(node):
        # what the part is rooted at (`np` of `np.allclose(f(x), y)`): a module would be the completion's.
        # Its arguments (f's inputs) are the completion's to choose anyway
        root = node
        while isinstance(root, (ast.Call, ast.Attribute, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in MODULES and root is not node:
            refuse(f"{ast.unparse(node).split('(')[0]} is a module's, and the module would be the "
                   f"completion's")
        node.jail = len(parts)
        parts.append(ast.unparse(node))

    def mark(node):
        if isinstance(node, ast.Constant):
            return
        if isinstance(node, ast.Name):
            if node.id == "math":
                refuse("math alone")
            return None if node.id in CALLS else jail(node)
        if isinstance(node, ast.Attribute):
            if trusted_attribute(node) is not None:
                return
            if not names_completion(node.value):
                refuse(f"{ast.unparse(node)} is not among what the trainer computes")
            return jail(node)
        if isinstance(node, ast.Call):
            return mark_call(node)
        if isinstance(node, OWN) and not (isinstance(node, ast.Dict) and None in node.keys):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    mark(child)
            return
        refuse(f"{type(node).__name__} outside a call into the completion")

    def mark_call(node):
        func, functions = node.func, function_args(node)
        if isinstance(func, ast.Name) and func.id in CALLS:
            if any(names_completion(f) for f in functions):
                return jail(node)
            if func.id != "isinstance" and not all(map(is_function, functions)):
                refuse(f"{', '.join(map(ast.unparse, functions))} as the function of {func.id}()")
        elif isinstance(func, ast.Attribute) and trusted_attribute(func) is not None:
            pass
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math":
            refuse(f"math.{func.attr} is not among the math functions the trainer computes")
        elif isinstance(func, ast.Attribute) and not names_completion(func.value):
            if not any(func.attr in methods for methods in METHODS.values()):
                refuse(f".{func.attr}() is not a method the trainer calls")
            mark(func.value)
        elif names_completion(func):
            return jail(node)
        else:
            refuse(f"the call {ast.unparse(node)}")
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            refuse("*args or **kwargs outside a call into the completion")
        for a in [*node.args, *(k.value for k in node.keywords)]:
            if not any(a is f for f in functions):
                mark(a)

    mark(body[0].test)
    if not parts:
        refuse("it names nothing of the completion's (a function named like a builtin, or isclose, is "
               "Python's: name it otherwise)")
    return body[0].test, parts


def free_names(node: ast.expr) -> set[str]:
    """The names `node` reads that none of its lambdas or comprehensions binds."""
    bound = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.comprehension, ast.NamedExpr)):
            bound |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def trusted_attribute(node: ast.Attribute):
    """`math.sqrt`, `math.pi`, `str.lower` (METHODS through the type) -> its value for the trainer, or None."""
    owner = node.value.id if isinstance(node.value, ast.Name) else None
    if owner == "math" and node.attr in MATH:
        return MATH_CALLS.get(node.attr, getattr(math, node.attr))
    if owner in TYPES and node.attr in METHODS[TYPES[owner]]:
        return unbound(TYPES[owner], node.attr)
    return None


def function_args(node: ast.Call) -> list[ast.expr]:
    """The arguments of a builtin call that are functions the builtin calls (FUNCTION_ARGS)."""
    if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTION_ARGS):
        return []
    position, keyword = FUNCTION_ARGS[node.func.id]
    return [a for i, a in enumerate(node.args) if i == position] + \
        [k.value for k in node.keywords if k.arg == keyword]


def is_function(node: ast.expr) -> bool:
    """Whether a function argument is one the trainer may call: a builtin's name (not map, sorted...:
    given a builtin as a value, `[range]`, they would call it unbounded), None, or a trusted_attribute."""
    return (isinstance(node, ast.Name) and node.id in CALLS and node.id not in FUNCTION_ARGS
            or isinstance(node, ast.Constant) and node.value is None
            or isinstance(node, ast.Attribute) and trusted_attribute(node) is not None)


def callable_of(node: ast.expr):
    """A function argument (is_function) as the trainer calls it: CALLS' bounded builtins."""
    if isinstance(node, ast.Name):
        return CALLS[node.id]
    return None if isinstance(node, ast.Constant) else trusted_attribute(node)


def judge(node: ast.expr, values: dict):
    """The value of a test's expression, evaluated here (split_test says what the trainer computes);
    `values` holds what the jail computed for each marked part, by index. Raises (KeyError for a part
    without a value, ValueError for a result too big to build) where the test fails."""
    value = lambda n: judge(n, values)
    if hasattr(node, "jail"):
        return values[node.jail]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):   # a builtin as a value (isinstance's class, type(x) == list)
        return getattr(builtins, node.id, CALLS.get(node.id))
    if isinstance(node, ast.Attribute):
        return trusted_attribute(node)
    if isinstance(node, ast.BoolOp):   # and/or stop at their first deciding value, as Python's
        for item in node.values:
            got = value(item)
            if bool(got) == isinstance(node.op, ast.Or):
                return got
        return got
    if isinstance(node, ast.Compare):
        left = value(node.left)
        for op, right in zip(node.ops, map(value, node.comparators)):
            if not CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](value(node.operand))
    if isinstance(node, ast.BinOp):
        return binary(node.op, value(node.left), value(node.right))
    if isinstance(node, ast.IfExp):
        return value(node.body) if value(node.test) else value(node.orelse)
    if isinstance(node, (ast.Tuple, ast.List)):
        return (tuple if isinstance(node, ast.Tuple) else list)(map(value, node.elts))
    if isinstance(node, ast.Set):
        return hashed(set, map(value, node.elts))
    if isinstance(node, ast.Dict):
        return hashed(dict, zip(map(value, node.keys), map(value, node.values)))
    if isinstance(node, ast.Subscript):
        return value(node.value)[value(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if n is None else value(n) for n in (node.lower, node.upper, node.step)))
    functions = function_args(node)
    arg = lambda n: callable_of(n) if any(n is f for f in functions) and node.func.id != "isinstance" \
        else value(n)
    args, kwargs = [arg(a) for a in node.args], {k.arg: arg(k.value) for k in node.keywords}
    func = node.func
    if isinstance(func, ast.Name):
        return CALLS[func.id](*args, **kwargs)
    if trusted_attribute(func) is not None:
        return trusted_attribute(func)(*args, **kwargs)
    return call_method(value(func.value), func.attr, args, kwargs)


def read_value(text: str, budget: list[int]):
    """A value the jail wrote (JSON of plain types, containers tagged: see sandbox.PLAIN), read without
    running anything and within bounds, counted before json parses it: budget[0] values and containers
    at most (the rest is taken off it, across the values of one completion), MAX_DEPTH deep, sets and
    dicts through `hashed`, integers of at most sys.get_int_max_str_digits() digits. ValueError (TypeError
    for an unhashable key, RecursionError for a nest too deep for json) otherwise."""
    if len(text) > OUTPUT_CAP:
        raise ValueError("longer than the jail may write")
    # every value is a scalar after a comma or a container's "[": both are counted, outside strings.
    # Where it matters, escapes go first, so that every quote left is a string's end, and the scan is
    # linear (else a string starts at each one)
    count = lambda t: t.count(",") + t.count("[") + 1
    bare = text if count(text) <= budget[0] else STRING.sub("", text.replace("\\\\", "").replace('\\"', ""))
    budget[0] -= count(bare)
    if budget[0] < 0:
        raise ValueError("too many values")
    return tagged(json.loads(text), MAX_DEPTH)


def tagged(value, depth: int):
    """json's value with its tagged containers built (["tuple", 1, 2] -> (1, 2)), at most `depth` deep.
    What Python compares by its items comes back as the same kind of object: a range as a range, a dict
    view as a view of a dict, an iterator (a generator, map, filter, zip...) as an iterator over its items."""
    if isinstance(value, dict):
        raise ValueError("a JSON object: the jail writes dicts as tagged lists")
    if not isinstance(value, list):
        return value
    if depth == 0:
        raise ValueError("nested too deep")
    tag, *rest = [tagged(x, depth - 1) for x in value] or [None]
    if tag in ("list", "tuple"):
        return rest if tag == "list" else tuple(rest)
    if tag in ("set", "frozenset"):
        return hashed(set if tag == "set" else frozenset, rest)
    if tag == "dict" and len(rest) % 2 == 0:
        return hashed(dict, zip(rest[::2], rest[1::2]))
    if tag == "bytes" and len(rest) == 1 and isinstance(rest[0], str):
        return bytes.fromhex(rest[0])
    if tag == "complex" and len(rest) == 2 and all(type(x) is float for x in rest):
        return complex(*rest)
    if tag == "range" and len(rest) == 3 and all(type(x) is int for x in rest):
        return bounded_range(*rest)
    if tag == "iter":
        return iter(rest)
    if tag == "dict_keys":
        return hashed(dict, ((k, None) for k in rest)).keys()
    if tag == "dict_values":
        return dict(enumerate(rest)).values()
    if tag == "dict_items" and all(type(p) is tuple and len(p) == 2 for p in rest):
        return hashed(dict, rest).items()
    raise ValueError(f"not a tagged container: {tag!r}")
