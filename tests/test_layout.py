"""The repository's shape, checked: the root holds the reference and nothing else (at most 10 .py
files), every module is short, the concept files import only the method files they need (rewards.py
none; test_margrpo.py runs each set alone), imports run down the layers (concept files < infra/ <
demo/ < models/ < scorers/ < train.py, evaluate.py < tables/, experiments/, benchmarks/ < tests),
nothing imports in a circle or reaches into train.py or the tests from product code, the run's
plumbing imports no concept file, no module resolves names on access (a module __getattr__), imports
sit at the top of files, and every relative link of the documents resolves. "Imports" counts every
import statement of a file, in functions too, and every module it imports by name through importlib."""

import ast
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

ROOT_FILES = {"README.md", "requirements.txt", "mar.py", "diffloss.py", "mte.py", "masks.py", "grpo.py", "rewards.py",
              "train.py", "test_margrpo.py", "rollout.py", "evaluate.py"}
FOLDERS = {"models", "scorers", "demo", "infra", "tables", "benchmarks", "tests", "experiments", "docs"}
MAX_ROOT_PY = 10  # .py files at the root: the method, its loop and evaluation, the card's test
# what each concept file may import from the project (docs/method.md's files copy out with these alone)
CONCEPT_IMPORTS = {"diffloss": set(), "masks": set(), "mte": {"diffloss"}, "mar": {"diffloss"},
                   "grpo": {"mte", "masks", "diffloss"}, "rollout": {"diffloss"}, "rewards": set()}
# imports inside functions: optional or slow packages that only the runs using them should pay for
LATE_IMPORTS = {"peft", "wandb", "transformers", "open_clip"}
MAX_LINES = 500  # lines a module holds at most (wrapped at 100 characters)


def python_files():
    return sorted(p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in python_files()}


def project_imports(path, top_level_only=False):
    """The project modules a file imports ({name}), with `from pkg import mod` resolved to pkg.mod."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or ({node.module} & MODULES.keys())
    return found


def imported_by_name(path):
    """The project modules a file imports by name through importlib, which no import statement
    shows: in a file that uses importlib, every string that names a module of a folder ("pkg.mod")
    or is given to import_module."""
    text = path.read_text()
    if "importlib" not in text:
        return set()
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            found |= {node.value} & MODULES.keys()
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            found |= {a.value for a in node.args if isinstance(a, ast.Constant) and a.value in MODULES}
    return found


def imports(path):
    """Every project module a file imports: its import statements (anywhere in it) and importlib."""
    return project_imports(path) | imported_by_name(path)


def test_the_root_holds_the_reference():
    entries = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in ("runs", "__pycache__")}
    assert entries == ROOT_FILES | FOLDERS, sorted(entries ^ (ROOT_FILES | FOLDERS))
    assert all((ROOT / f / "__init__.py").is_file() for f in FOLDERS - {"docs"})  # plain importable folders
    assert len(list(ROOT.glob("*.py"))) <= MAX_ROOT_PY, sorted(p.name for p in ROOT.glob("*.py"))


def test_modules_are_short_and_root_files_wrap_at_100():
    long = {str(p.relative_to(ROOT)): n for p in python_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
    wide = {f: [i + 1 for i, line in enumerate((ROOT / f).read_text().splitlines()) if len(line) > 100]
            for f in ROOT_FILES if f.endswith(".py")}
    assert not {f: lines for f, lines in wide.items() if lines}, wide


# what `import train` may load of the project: the method files, the policy's loading, the run's
# plumbing, the evaluation loop and the reward registry (which scorer a name builds, and their weight
# files); no scorer, and nothing of experiments/ or tables/, until a run names them
TRAIN_IMPORT_FILES = 28
REGISTRY_FILES = {"scorers/__init__.py", "scorers/registry.py", "scorers/weights.py"}


def test_import_train_loads_what_a_run_needs_and_no_scorer():
    # the project's own files: under the checkout, outside the interpreter's (CI's venv sits in .ci/)
    code = ("import sys, os, train; root = os.getcwd() + os.sep; lib = (sys.prefix + os.sep, sys.base_prefix + os.sep); "
            "print('\\n'.join(sorted(f[len(root):] for f in (getattr(m, '__file__', None) or '' for m in "
            "list(sys.modules.values())) if f.startswith(root) and not f.startswith(lib))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    files = out.stdout.split()
    assert not [f for f in files if f.startswith(("scorers/", "experiments/", "tables/", "benchmarks/", "tests/"))
                and f not in REGISTRY_FILES], files
    assert len(files) <= TRAIN_IMPORT_FILES, files


# the layers, lowest first: a module imports only from lower layers, besides its own folder (the root's
# files among themselves: CONCEPT_IMPORTS and "nothing imports train.py")
LAYERS = {"<concept>": 0, "infra": 1, "demo": 2, "models": 3, "scorers": 4, "evaluate": 5, "train": 6,
          "tables": 7, "experiments": 7, "benchmarks": 7, "tests": 8}


def layer_of(name):
    """(group, layer) of a module: its folder, evaluate.py, train.py, or a concept file (the card's
    test_margrpo.py counts with the tests)."""
    group = "tests" if name == "test_margrpo" else name.split(".")[0]
    group = group if group in LAYERS else "<concept>"
    return group, LAYERS[group]


def test_imports_run_down_the_layers():
    """Folders import the root and each other downward only, in function bodies and through importlib
    too: no file imports one of a higher layer (e.g. the registry of scorers/ builds a scorer of its
    folder or demo/ by name, never a reward of a folder above it), so no two folders import each
    other."""
    up = sorted((name, dep) for name, path in MODULES.items() for dep in imports(path)
                if layer_of(dep)[0] != layer_of(name)[0] and layer_of(dep)[1] >= layer_of(name)[1])
    assert not up, up


def test_the_runs_plumbing_imports_no_concept_file():
    """infra/ (flags, processes, checkpoints, the run folder, ...) is given what it needs of the method
    (grpo.METHODS, the exception types that stop a run) by its callers."""
    concept = {n for n in MODULES if layer_of(n)[0] == "<concept>"}
    reached = sorted((name, dep) for name, path in MODULES.items() if name.startswith("infra")
                     for dep in imports(path) if dep in concept)
    assert not reached, reached


def test_no_module_resolves_names_on_access():
    """No module-level __getattr__ (PEP 562): what a module holds is what it defines or imports."""
    lazy = [name for name, path in MODULES.items()
            if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in ast.parse(path.read_text()).body)]
    assert not lazy, lazy


def test_concept_files_import_only_the_method_files_they_need():
    """rewards.py imports nothing of the project, not even by name (which scorer a name builds is
    scorers/registry.py's)."""
    for name, allowed in CONCEPT_IMPORTS.items():
        assert imports(MODULES[name]) <= allowed, (name, imports(MODULES[name]) - allowed)


def test_no_import_circle_and_no_reaching_into_train_or_the_tests():
    """No file imports one that imports it back, counting every import (in functions, by name)."""
    graph = {name: imports(path) for name, path in MODULES.items()}
    reference = [n for n in graph if n.split(".")[0] in ROOT_FILES_MODULES | {"models", "scorers", "demo", "infra"}]
    for name in reference:
        assert "train" not in graph[name] or name == "train", f"{name} imports train.py"
    for name in graph:
        if not name.startswith("tests") and name != "test_margrpo":
            assert not any(m.startswith("tests") or m == "test_margrpo" for m in project_imports(MODULES[name])), name
    done, path = set(), []

    def visit(n):
        if n in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
        if n in done:
            return
        path.append(n)
        for m in graph.get(n, ()):
            visit(m)
        path.pop()
        done.add(n)
    for n in graph:
        visit(n)


ROOT_FILES_MODULES = {f[:-3] for f in ROOT_FILES if f.endswith(".py")}


@pytest.mark.parametrize("path", [p for p in python_files() if not p.relative_to(ROOT).parts[0] == "tests"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_sit_at_the_top(path):
    """An import inside a function is only for a package that only some runs use and that takes
    seconds to import (LATE_IMPORTS); everything else is imported at the top of its file."""
    late = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    late += [a.name for a in inner.names]
                elif isinstance(inner, ast.ImportFrom):
                    late.append(inner.module or "")
    assert all(name.split(".")[0] in LATE_IMPORTS for name in late), late


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("experiments/*.md")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = [target for target in LINK.findall(doc.read_text())
              if "://" not in target and not target.startswith("mailto:") and not (doc.parent / target).exists()]
    assert not broken, broken
