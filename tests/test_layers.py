"""ARCHITECTURE.md's layer table is true: every module imports only modules of its own layer or the layers above."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "servopt"


def layers() -> dict[str, int]:
    """Module path prefix (relative to src/servopt) → layer number, from the table in ARCHITECTURE.md."""
    table: dict[str, int] = {}
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|[^|]*\|([^|]*)\|", line)
        if m:
            for path in re.findall(r"`([^`]+)`", m.group(2)):
                table[path.rstrip("/")] = int(m.group(1))
    return table


def layer_of(rel: str, table: dict[str, int]) -> int | None:
    """The layer of a module path like ``serve/rest.py`` or a package ``serve``."""
    best = None
    for prefix, n in table.items():
        stem = prefix.removesuffix(".py")
        matches = rel == prefix or rel.startswith(stem + "/") or rel.removesuffix(".py") == stem
        if matches and (best is None or len(prefix) > len(best[0])):
            best = (prefix, n)
    return best[1] if best else None


def module_path(name: str) -> str | None:
    """``servopt.serve.rest`` → ``serve/rest.py`` (or the package folder)."""
    parts = name.split(".")[1:]
    if not parts:
        return None
    candidate = SRC.joinpath(*parts)
    if candidate.with_suffix(".py").exists():
        return "/".join(parts) + ".py"
    if candidate.is_dir():
        return "/".join(parts)
    return "/".join(parts[:-1]) if len(parts) > 1 else None  # `from servopt.x import name`


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("servopt")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("servopt") and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if module_path(f"{node.module}.{a.name}")}
    return out


def test_every_module_is_in_a_layer():
    table = layers()
    assert len(table) > 20, "the table was not found in ARCHITECTURE.md"
    missing = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
               if layer_of(str(p.relative_to(SRC)), table) is None and p.name != "__init__.py" and "proto" not in p.parts]
    assert not missing, f"modules in no layer of ARCHITECTURE.md: {missing}"


def test_no_module_imports_a_lower_layer():
    table = layers()
    violations = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        mine = layer_of(rel, table)
        if mine is None:
            continue
        for name in imports(path):
            target = module_path(name)
            theirs = layer_of(target, table) if target else None
            if theirs is not None and theirs > mine:
                violations.append(f"{rel} (layer {mine}) imports {name} (layer {theirs})")
    assert not violations, "\n".join(violations)


def _module_file(name: str) -> str | None:
    """``servopt.serve.rest`` → ``serve/rest.py``; a package → its ``__init__.py``; ``servopt.x.name`` → ``x.py``."""
    parts = name.split(".")[1:]
    while parts:
        candidate = SRC.joinpath(*parts)
        if candidate.with_suffix(".py").exists():
            return "/".join(parts) + ".py"
        if (candidate / "__init__.py").exists():
            return "/".join(parts) + "/__init__.py"
        parts = parts[:-1]
    return None


def test_no_import_circles():
    """No module reaches itself through imports (function-level ones included): a circle means two modules each know
    the other, and one of them belongs elsewhere. A package's ``__init__`` re-exporting its own modules is no circle."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        if "proto" in path.parts:
            continue
        package = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
        targets = {_module_file(n) for n in imports(path)} - {None, rel}
        # an __init__ importing its own package's modules only re-exports them
        graph[rel] = {t for t in targets if not (rel.endswith("__init__.py") and t.startswith(package))}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" → ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(circles)


BENCHMARKS = ROOT / "benchmarks"


def _script_imports(path: Path) -> set[str]:
    """The top-level names a benchmark script imports (function-level imports included); a relative import is '.'."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." if node.level else (node.module or "").split(".")[0])
    return out


def test_no_benchmark_script_imports_another():
    """benchmarks/ is a thin shell over the library (issue 35): a script imports servopt, the standard library and
    third-party packages, never another script (``text_speed.py`` was imported as a library by four others, and
    ``serve_cpu.py`` ⇄ ``text_servers.py`` was the project's only import circle). What two scripts share belongs in
    the library, tested. Running another script as a process (a worker in a peer's environment) is fine."""
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    wrong = [f"{p.name} imports {', '.join(sorted(names))}" for p in sorted(BENCHMARKS.glob("*.py"))
             if (names := _script_imports(p) & (scripts | {"."}))]
    assert not wrong, "\n".join(wrong)
    # putting its own folder on sys.path is how a script would import another; another folder (unpacked wheels) is not
    own_folder = re.compile(r"sys\.path\.(insert|append)\(.*(__file__|HERE|benchmarks)")
    sys_path = [p.name for p in BENCHMARKS.glob("*.py") if own_folder.search(p.read_text())]
    assert not sys_path, f"scripts putting their own folder on sys.path (to import a script): {sys_path}"
    assert own_folder.search('sys.path.insert(0, str(Path(__file__).parent))') and not own_folder.search("sys.path.insert(0, str(site))")


def test_architecture_maps_every_benchmark_script():
    """ARCHITECTURE.md's benchmarks table names each script in benchmarks/ once, and no script that is gone."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    lines = text[text.index("<!-- benchmarks:"):].splitlines()[1:]
    table = lines[:next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]
    mapped = [m.group(1) for line in table if (m := re.match(r"\|\s*`([a-z0-9_]+)\.py`", line))]
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert sorted(mapped) == scripts, f"mapped but absent: {sorted(set(mapped) - set(scripts))}; " \
                                      f"absent from the table: {sorted(set(scripts) - set(mapped))}"


def _retired() -> tuple[str, set[str]]:
    """docs/benchmarks.md's "Retired scripts" table: the revision that last held them, and their names."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    lines = text[text.index("<!-- retired:"):].splitlines()[1:]
    table = lines[:next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]
    rev = re.search(r"script \(at `([0-9a-f]{7,40})`\)", table[0])
    assert rev, "the retired table's header names the revision that held the scripts: script (at `<rev>`)"
    names = {n for line in table[2:] for n in re.findall(r"`([a-z0-9_]+)\.py`", line.split("|")[1])}
    return rev.group(1), names


def test_every_script_the_docs_cite_is_here_or_retired_at_a_revision_that_has_it():
    """Retiring a one-off investigation (issue 35) must not leave a doc telling a user to run a file that is gone:
    each ``benchmarks/x.py`` the docs cite is in benchmarks/, or in docs/benchmarks.md's retired table, whose revision
    holds it (``git show <rev>:benchmarks/x.py`` runs it from there)."""
    import shutil
    import subprocess

    rev, retired = _retired()
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert not retired & scripts, f"retired but still in benchmarks/: {sorted(retired & scripts)}"
    docs = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = {(d.name, m) for d in docs for m in re.findall(r"benchmarks/([a-z0-9_]+)\.py", d.read_text(encoding="utf-8"))}
    missing = sorted(f"{doc} cites benchmarks/{name}.py" for doc, name in cited if name not in scripts | retired)
    assert not missing, "\n".join(missing) + "\n(retire it in docs/benchmarks.md's table, or point to the new command)"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the retired revision cannot be read")
    absent = [n for n in sorted(retired) if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:benchmarks/{n}.py"],
                                                           capture_output=True).returncode != 0]
    assert not absent, f"revision {rev} does not hold benchmarks/{', '.join(absent)}.py"


LOAD = SRC / "serve" / "load"
# what sending load looks like: an HTTP client library, a raw connection, a gRPC inference stub, Poisson arrivals
SENDING_IMPORTS = {"aiohttp", "http.client", "urllib.request", "requests", "urllib3"}
SENDING_NAMES = {"open_connection", "GRPCInferenceServiceStub", "expovariate"}


def _timed_request_loops(tree: ast.AST) -> list[int]:
    """Lines of loops that send a request (``.post(`` / ``.request(``) and time something (a clock read minus another
    value) in the same loop: a hand-made load loop timing its requests. (A wait polling a clock against a deadline
    times nothing.)"""
    def clock(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("perf_counter", "monotonic", "perf_counter_ns", "time"))

    found = []
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For | ast.While | ast.AsyncFor)):
        body = [n for stmt in loop.body for n in ast.walk(stmt)]
        sends = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("post", "request")
                    for n in body)
        times = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and clock(n.left) for n in body)
        if sends and times:
            found.append(loop.lineno)
    return found


def test_the_load_generator_is_the_only_request_loop():
    """One load generator (issue 42): ``serve/load/`` is the only place that sends load. No other module of servopt or
    script of benchmarks/ imports an HTTP client to send with (aiohttp, http.client …), opens raw connections, makes a
    gRPC inference stub, draws Poisson arrivals, or times requests in a loop of its own: three loops with their own
    tallies and words for "dropped" had grown before (serve/loadtest.py, serve/rawhttp.py, serve/overload.py)."""
    wrong = []
    for path in sorted([*SRC.rglob("*.py"), *BENCHMARKS.glob("*.py")]):
        if LOAD in path.parents or "proto" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{rel}:{node.lineno} imports {n}" for n in names if n in SENDING_IMPORTS or n.split(".")[0] == "aiohttp"]
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in SENDING_NAMES:
                wrong.append(f"{rel}:{node.lineno} uses {name}")
        wrong += [f"{rel}:{line} times requests in a loop of its own" for line in _timed_request_loops(tree)]
    assert not wrong, "send load through servopt.serve.load (a schedule × a sender × its tally):\n" + "\n".join(wrong)
    sample = ast.parse("import time\ndef f(c):\n    for i in range(3):\n        t0 = time.perf_counter()\n"
                       "        c.post('/x')\n        print(time.perf_counter() - t0)\n")
    assert _timed_request_loops(sample) == [3], "the check sees a hand-made timed loop"
