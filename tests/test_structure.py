"""The package's shape, checked from its source with ``ast`` (issues 23, 34 and 51): every concept has a named home of
bounded size (a class over ~300 lines, or a module over ~600, is a concept without a name; the optimizer class,
which holds torch.optim's conventions, is allowed 350), no module imports another in a loop, a bucket's step is told
in records by phase (no look-ups keyed by ``id(bucket)``, no class of more than 20 fields but the options and the
optimizer, no record of the step's phases of more than 12), the state's buffers are read behind its home's seam
only, the optimizer does not branch on the kind of topology, the update rule's buffer names live in the rule, and
no source file of the repository loads a name that nothing in it binds (a helper deleted while still called: the
GPU runbook's pinned probe lost a lease stage so)."""

from __future__ import annotations

import ast
import builtins
import pathlib
import re
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zero_offload"
MAX_CLASS, MAX_MODULE = 300, 600
# torch.optim's conventions (param groups, step, clipping, hooks) in one class, as torch's own optimizers are.
CLASS_LIMITS = {"optimizer.py:OffloadOptimizer": 350}
# Fields a class may hold (slots, annotated fields, attributes set on self, its package bases' included): what the
# user asked for and the torch.optim facade may hold more; the records of a bucket's step, in the modules that tell
# it, are small and named by phase.
MAX_FIELDS, MAX_RECORD_FIELDS = 20, 12
FIELD_LIMITS = {"options.py:Options": None, "optimizer.py:OffloadOptimizer": None}
STEP_MODULES = ("lane.py", "grad_stream.py", "gate.py", "update.py", "transport/")
# Where a bucket's flat state buffers may be read: its home (state/), the rules it runs, and the bucket itself.
BUFFER_READERS = ("state/", "rules/", "buckets.py")
_BUFFERS = re.compile(r"store\.flat\b|\.master\b")
# Adam's buffer names may appear in its rule and in the kernel's API (functional, the references) only; Lion's
# momentum has the same state-dict key (``exp_avg``, as in the reference Lion implementations), in its rule and its
# torch optimizer.
ADAM_NAMES_ALLOWED = {"rules/adamw.py", "functional.py", "_checks.py", "quantize.py", "_reference.py", "_torch_fused.py",
                      "rules/lion.py", "lion.py"}
REPO = PACKAGE.parent
# Nodes that bind a name in ``name`` (match patterns only from Python 3.10 on; the floor is 3.9).
NAMING_NODES = tuple(getattr(ast, n) for n in ("ExceptHandler", "MatchAs", "MatchStar") if hasattr(ast, n))
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__package__", "__builtins__",
                  "__loader__"}
# Compiled modules of the package (no source here, and they import nothing of ours).
EXTENSIONS = {"zero_offload._C"}


def _modules() -> Iterator[Tuple[str, pathlib.Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path


def _name(rel: str) -> str:
    parts = ["zero_offload", *rel[:-3].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _span(node: ast.AST) -> int:
    """Lines of a def or class, its decorators and docstring included."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return node.end_lineno - first + 1


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, modules: Set[str]) -> Set[str]:
    """The package's ``modules`` that a module imports, anywhere in it (a function-level import is a dependency
    too), leaving out ``if TYPE_CHECKING:`` blocks. ``from zero_offload import functional`` depends on
    ``zero_offload.functional``, not on the package's ``__init__``."""
    out: Set[str] = set()
    skip = {id(n) for t in ast.walk(tree) if _type_checking(t) for n in ast.walk(t)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("zero_offload"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zero_offload"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            out.update(subs & modules)
            if not subs <= modules:
                out.add(node.module)
    return out


def sizes() -> Tuple[List[Tuple[str, int]], List[Tuple[str, int]], List[Tuple[str, int]]]:
    """(functions over 60 lines, classes over their limit, modules over 600 lines), as (where, lines)."""
    long_defs, long_classes, long_modules = [], [], []
    for rel, path in _modules():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE:
            long_modules.append((rel, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > 60:
                long_defs.append((f"{rel}:{node.name}", _span(node)))
            where = f"{rel}:{getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef) and _span(node) > CLASS_LIMITS.get(where, MAX_CLASS):
                long_classes.append((where, _span(node)))
    return long_defs, long_classes, long_modules


_BUCKET_ID = re.compile(r"\bid\((?:[\w.]+\.)?(bucket|b|bg|lane|spec|state)\)")


def bucket_id_lookups() -> List[str]:
    """Places that key something by ``id`` of a bucket (or of its record): the lane is that record."""
    return [f"{rel}:{i}" for rel, path in _modules() for i, line in enumerate(path.read_text().splitlines(), 1)
            if _BUCKET_ID.search(line)]


def import_cycles() -> List[List[str]]:
    modules = {_name(rel): path for rel, path in _modules()}
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        imported = _imports(ast.parse(path.read_text()), set(modules) | EXTENSIONS)
        graph[name] = {m for m in imported if m in modules and m != name}
    cycles, state = [], {}

    def visit(node: str, stack: List[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def adam_names_outside_rule() -> List[str]:
    return [f"{rel}:{i}" for rel, path in _modules() if rel not in ADAM_NAMES_ALLOWED
            for i, line in enumerate(path.read_text().splitlines(), 1) if "exp_avg" in line]


def unbound_names(text: str) -> List[Tuple[str, int]]:
    """Names a module loads that nothing in it binds, anywhere (an assignment, def, class, argument, import,
    ``except ... as``, ``global``, match capture) and that are not builtins, as (name, line). Scopes are not told
    apart, so it misses a name bound in one function and loaded in another: it finds what fails in every scope."""
    tree = ast.parse(text)
    bound = set(dir(builtins)) | MODULE_DUNDERS
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            bound.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in n.names):
                return []
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, NAMING_NODES) and n.name:
            bound.add(n.name)
        elif type(n).__name__ == "MatchMapping" and n.rest:
            bound.add(n.rest)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            bound.update(n.names)
    return sorted({(n.id, n.lineno) for n in ast.walk(tree)
                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound})


def unbound_in_repository() -> List[str]:
    paths = [REPO / "setup.py", *(p for d in ("zero_offload", "benchmarks", "examples", "tests")
                                   for p in sorted((REPO / d).rglob("*.py")))]
    return [f"{p.relative_to(REPO)}:{line} {name}" for p in paths for name, line in unbound_names(p.read_text())]


def _fields(cls: ast.ClassDef) -> Set[str]:
    """What a class holds: its ``__slots__``, its fields if it is a dataclass or a NamedTuple (annotated at class
    level), and every attribute its methods set on ``self``."""
    names: Set[str] = set()
    record = any("dataclass" in ast.unparse(d) for d in cls.decorator_list) or any(
        ast.unparse(b).endswith("NamedTuple") for b in cls.bases)
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            names.update(n for n in ast.literal_eval(node.value) if n not in ("__weakref__", "__dict__"))
        elif record and isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and "ClassVar" not in ast.unparse(node.annotation):
            names.add(node.target.id)
    for fn in ast.walk(cls):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args and fn.args.args[0].arg == "self":
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                    n, (ast.AugAssign, ast.AnnAssign)) else []
                names.update(e.attr for t in targets for e in ast.walk(t)
                             if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self")
    return names


def field_counts() -> Dict[str, int]:
    """Each class of the package (``module:Class``) and the fields it holds, with those of its bases defined in the
    package (by name: the base of that name in the class's own module first, else the first defined)."""
    own: Dict[Tuple[str, str], Tuple[Set[str], List[str]]] = {}
    first: Dict[str, Tuple[str, str]] = {}
    for rel, path in _modules():
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            own.setdefault((rel, cls.name), (_fields(cls), [ast.unparse(b).split(".")[-1] for b in cls.bases]))
            first.setdefault(cls.name, (rel, cls.name))

    def every(key: Tuple[str, str], seen: Tuple[Tuple[str, str], ...] = ()) -> Set[str]:
        if key not in own or key in seen:
            return set()
        names, bases = own[key]
        found = [(key[0], b) if (key[0], b) in own else first.get(b) for b in bases]
        return set(names).union(*(every(b, seen + (key,)) for b in found if b is not None))

    return {f"{rel}:{name}": len(every((rel, name))) for rel, name in own}


def too_many_fields() -> List[Tuple[str, int]]:
    """Classes over :data:`MAX_FIELDS`, and classes of the step's modules over :data:`MAX_RECORD_FIELDS`."""
    out = []
    for where, n in field_counts().items():
        if where in FIELD_LIMITS:
            continue
        limit = MAX_RECORD_FIELDS if where.startswith(STEP_MODULES) else MAX_FIELDS
        if n > limit:
            out.append((where, n))
    return out


def buffer_reads_outside_the_home() -> List[str]:
    """Lines outside :data:`BUFFER_READERS` that read a bucket's flat state buffers (``store.flat``, ``.master``)."""
    return [f"{rel}:{i}" for rel, path in _modules() if not rel.startswith(BUFFER_READERS)
            for i, line in enumerate(path.read_text().splitlines(), 1) if _BUFFERS.search(line)]


def topology_branches() -> List[str]:
    """Lines of optimizer.py that test the kind of topology (``_fsdp``, ``sharded``): the topology answers."""
    text = (PACKAGE / "optimizer.py").read_text()
    return [f"optimizer.py:{i}" for i, line in enumerate(text.splitlines(), 1) if re.search(r"_fsdp|sharded", line)]


def test_no_class_holds_too_many_fields_and_the_records_of_a_step_are_small():
    assert not too_many_fields(), too_many_fields()
    counts = field_counts()
    assert counts["lane.py:Lane"] <= MAX_RECORD_FIELDS and counts["buckets.py:FlatBucket"] <= MAX_FIELDS


def test_the_state_buffers_are_read_behind_the_home_only():
    assert not buffer_reads_outside_the_home()
    assert _BUFFERS.search("b.store.flat[name]") and _BUFFERS.search("bucket.master.clone()")
    assert not _BUFFERS.search("bucket.master_views") and not _BUFFERS.search("bucket.store.flat_views")


def test_the_optimizer_does_not_branch_on_the_topology():
    assert not topology_branches()


def test_no_function_over_60_lines_no_class_over_300_no_module_over_600():
    long_defs, long_classes, long_modules = sizes()
    assert not long_defs, long_defs
    assert not long_classes, long_classes
    assert not long_modules, long_modules


def test_no_lookup_keyed_by_the_id_of_a_bucket():
    assert not bucket_id_lookups()
    assert _BUCKET_ID.search("self._links[id(bucket)]") and _BUCKET_ID.search("x[id(bg.bucket)]")


def test_no_import_cycle():
    assert not import_cycles()


def test_adam_buffer_names_live_in_the_adamw_rule():
    assert not adam_names_outside_rule()


def test_no_source_file_loads_a_name_nothing_binds():
    assert not unbound_in_repository()
    assert unbound_names("def f():\n    return probe_room()\n") == [("probe_room", 2)]
    bound_every_way = "import os.path as p\nfrom a import b\ntry:\n    pass\nexcept E as e:\n    e, b, p\n"
    assert unbound_names(bound_every_way) == [("E", 5)]


if __name__ == "__main__":
    print("long functions, long classes, long modules:", sizes())
    print("look-ups by id of a bucket:", bucket_id_lookups())
    print("import cycles:", import_cycles())
    print("names nothing binds:", unbound_in_repository())
    print("'exp_avg' outside the rule and kernel API:", adam_names_outside_rule())
    print("classes with too many fields:", too_many_fields())
    print("state buffers read outside the home:", buffer_reads_outside_the_home())
    print("topology branches in optimizer.py:", topology_branches())
