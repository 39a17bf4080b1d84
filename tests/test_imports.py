"""No import cycle among the top-level modules: each *.py at the repository's root, its imports
read with `ast` wherever they stand (a function-level import is an edge too), so that the modules layer
cleanly."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_graph(root: str) -> dict[str, set[str]]:
    """module -> the top-level modules it imports (itself left out)."""
    modules = {f[:-3] for f in os.listdir(root) if f.endswith(".py")}
    graph = {}
    for m in modules:
        with open(os.path.join(root, m + ".py")) as f:
            tree = ast.parse(f.read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        graph[m] = (names & modules) - {m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_cycles_through_function_level_imports(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("import os\nimport a.sub\n")
    (tmp_path / "d.py").write_text("import a, c\n")
    assert import_graph(str(tmp_path)) == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "c"}}
    assert cycles(import_graph(str(tmp_path))) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_top_level_modules():
    assert cycles(import_graph(ROOT)) == []


def test_importing_grpo_train_parses_nothing_starts_nothing_and_leaves_peft_and_math_verify_out():
    """`import grpo_train` (as the ref server and these tests do) must not parse argv or spawn anything. And
    peft takes 1.5 s to import (0.55 s of `import grpo_train`, median of 5 interleaved, once its share of
    transformers is counted elsewhere), and the generation process imports grpo_train.py again at its start:
    only --lora-rank > 0 imports it (run_setup.load_policy). Likewise math-verify (0.4 s, with sympy): only
    the gsm8k reward imports it, at its first answer."""
    import subprocess
    import sys
    probe = ("import sys, multiprocessing as mp; sys.argv = ['x', '--no-such-flag']; import grpo_train; "
             "assert not mp.active_children(); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('peft', 'math_verify')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]
