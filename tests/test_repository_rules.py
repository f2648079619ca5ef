"""Repository rules checked on every test run: formatting, lint, strict typing, structure, and hygiene.

These run the real tools over the real tree, so `uv run pytest` is the whole check.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
STRICT_TYPED = [
    "packages/dart-protocol/src",
    "packages/dart-runtime/src",
    "packages/dart-policy/src",
    "packages/dart-data/src",
    "packages/dart-env/src",
    "packages/dart-rollout/src",
    "packages/dart-train/src",
    "packages/dart-embedded/src",
    "apps/dart-cli/src",
]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def _tracked_files() -> list[Path]:
    out = _run("git", "ls-files", "-co", "--exclude-standard")
    return [ROOT / line for line in out.stdout.splitlines() if line and (ROOT / line).is_file()]


def test_ruff_format() -> None:
    res = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_lint() -> None:
    res = _run(sys.executable, "-m", "ruff", "check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


# One run over every package: each run analyses torch and transformers again (40 s apiece), and a package's
# errors are named by file either way. The session runs it beside the end-to-end runs (conftest's checks ahead).
@pytest.mark.run_ahead(sys.executable, "-m", "mypy", "--strict", "--no-incremental", *STRICT_TYPED)
def test_mypy_strict(ran_ahead: subprocess.CompletedProcess[str]) -> None:
    assert ran_ahead.returncode == 0, ran_ahead.stdout[-5000:]


def test_no_subject_literals_outside_subjects_module() -> None:
    pattern = re.compile(r"""["']dart\.v1\.""")
    offenders = [
        str(p.relative_to(ROOT))
        for p in _tracked_files()
        if p.suffix == ".py" and p.name != "subjects.py" and pattern.search(p.read_text(errors="replace"))
    ]
    assert offenders == []


COLLECTIVES = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
        "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
        "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    }
)  # fmt: skip


def distributed_collective_calls(source: str) -> list[int]:
    """Lines of ``source`` that call a torch.distributed collective (as ``dist.X`` or ``torch.distributed.X``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                lines.append(node.lineno)
    return lines


def test_the_collective_finder_finds_collectives() -> None:
    found = "import torch.distributed as dist\ndist.barrier()\ntorch.distributed.all_reduce(t, group=g)\n"
    found += "x.all_reduce()\n"  # not torch.distributed's
    assert distributed_collective_calls(found) == [2, 3]


def test_dart_train_calls_collectives_only_through_its_collectives_module() -> None:
    """NCCL takes CUDA tensors only: one module moves every collective's tensors to the group's device."""
    src = ROOT / "packages" / "dart-train" / "src"
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(src.rglob("*.py"))
        if path.name != "collectives.py"
        for line in distributed_collective_calls(path.read_text())
    ]
    assert offenders == []


def test_no_machine_paths_secrets_or_ips_in_tracked_files() -> None:
    # Assembled from parts so this file does not match its own patterns.
    home, root, key = "/" + "home/[a-z]", "/" + "root/", "AKIA" + "[0-9A-Z]{12}"
    bad = re.compile(
        rf"({home}|{root}|{key}|BEGIN (RSA|OPENSSH) PRIVATE" + " KEY"
        r"|\b(10\.\d+\.\d+\.\d+|192\.168\.\d+\.\d+|172\.(1[6-9]|2\d|3[01])\.\d+\.\d+)\b)"
    )
    offenders = []
    for path in _tracked_files():
        if path.suffix in {".lock", ".png"}:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if bad.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert offenders == []


def test_no_namespace_init_files() -> None:
    stray = [str(p.relative_to(ROOT)) for p in ROOT.glob("*/*/src/dart/__init__.py")]
    assert stray == [], "dart is a namespace package: no dart/__init__.py"


def _dart_modules() -> dict[str, tuple[Path, bool]]:
    """Every ``dart.*`` module of the workspace: dotted name -> (its file, whether it is a package)."""
    modules = {}
    for path in [*ROOT.glob("packages/*/src/dart/**/*.py"), *ROOT.glob("apps/*/src/dart/**/*.py")]:
        src = next(parent for parent in path.parents if parent.name == "src")
        parts = path.relative_to(src).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    """The modules one import statement of a module in ``package`` names (relative ones resolved)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    levels = package.split(".")
    base = levels[: len(levels) - node.level + 1] if node.level else []
    module = ".".join([*base, *([node.module] if node.module else [])])
    yield module
    yield from (f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`


def _module_level_imports(tree: ast.Module, package: str) -> Iterator[str]:
    """What a module imports when it is imported, ``if TYPE_CHECKING:`` blocks included (functions not)."""
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield from _imported(node, package)
        elif isinstance(node, ast.If | ast.With):
            stack.extend([*node.body, *getattr(node, "orelse", [])])
        elif isinstance(node, ast.Try):
            stack.extend([*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)])


def _import_graph() -> dict[str, set[str]]:
    """dart module -> the dart modules that importing it imports directly."""
    modules = _dart_modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        imported = {m for m in _module_level_imports(ast.parse(path.read_text()), package) if m in modules}
        # Importing a.b.c runs a/__init__ and a/b/__init__ first; a module's own packages are already running.
        for module in list(imported):
            parent = module.rpartition(".")[0]
            while parent:
                if parent in modules and not name.startswith(parent + "."):
                    imported.add(parent)
                parent = parent.rpartition(".")[0]
        graph[name] = imported - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle for every back edge a depth-first walk of ``graph`` meets (none: the graph is acyclic)."""
    done: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in done:
            continue
        path, pending = [root], [iter(sorted(graph[root]))]
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:
                done.add(path.pop())
                pending.pop()
            elif nxt in path:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                path.append(nxt)
                pending.append(iter(sorted(graph[nxt])))
    return cycles


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_among_dart_modules() -> None:
    # Annotation-only imports under `if TYPE_CHECKING:` count too: such a cycle still ties two modules
    # together (neither can be read, typed or moved without the other), and none is needed.
    cycles = _cycles(_import_graph())
    assert cycles == [], "import cycles among dart modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


MAX_FUNCTION_LINES = 80
"""Longest function (docstring included) in the packages' and apps' sources: a longer one reads better split."""


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for path in sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("apps/*/src/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines; split them into named steps:\n" + "\n".join(long)


def _config_modules() -> list[str]:
    """Every ``config`` / ``*_config`` module of the packages and apps, by dotted name."""
    paths = [*ROOT.glob("packages/*/src/dart/**/*config.py"), *ROOT.glob("apps/*/src/dart/**/*config.py")]
    # packages/<package>/src/dart/... -> dart....
    parts = [path.relative_to(ROOT).with_suffix("").parts[3:] for path in sorted(paths)]
    return [".".join(p) for p in parts if p[-1] == "config" or p[-1].endswith("_config")]


def test_no_config_module_imports_torch() -> None:
    # Configs are read by every tool and service (dart doctor, the CLI, a config check on a machine without a GPU
    # stack): importing one must not pull in torch or transformers, which take seconds and gigabytes.
    modules = _config_modules()
    assert "dart.train.config" in modules and "dart.rollout.engine.hf_config" in modules
    heavy = ("torch", "transformers")
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = _run(sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing the config modules imported {out.stdout.strip()}"


CONTRACT_FORBIDDEN = (
    *("dart.runtime", "nats", "minio", "opentelemetry", "urllib3", "prometheus_client"),
    *("dart.policy", "torch", "transformers", "peft"),
)
"""What dart-protocol (the contract) never imports, anywhere in a module (function bodies included): the runtime
and the clients it wraps, and what the model sees and says with the model libraries it needs. Every service
depends on the contract and the runtime; a tool that only reads or writes messages needs the contract alone."""


def test_the_contract_imports_no_runtime_and_no_client() -> None:
    found = []
    sources = sorted((ROOT / "packages/dart-protocol/src").rglob("*.py"))
    assert any(p.name == "topology.py" for p in sources)
    for path in sources:
        package = ".".join(path.relative_to(ROOT / "packages/dart-protocol/src").with_suffix("").parts[:-1])
        statements = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)]
        for name in (m for node in statements for m in _imported(node, package)):
            if any(name == bad or name.startswith(bad + ".") for bad in CONTRACT_FORBIDDEN):
                found.append(f"{path.relative_to(ROOT)}: {name}")
    assert found == [], "dart-protocol is the contract; these belong in dart-runtime or dart-policy:\n" + "\n".join(
        found
    )
    # Its declared dependencies say the same.
    declared = (ROOT / "packages/dart-protocol/pyproject.toml").read_text()
    assert all(client.replace("_", "-") not in declared for client in ("nats-py", "minio", "opentelemetry"))


def _dart_imports(paths: list[Path]) -> Iterator[tuple[Path, str]]:
    """Every ``dart.*`` module the Python files ``paths`` import, anywhere in a module (function bodies and
    ``if TYPE_CHECKING:`` blocks included), with the file that imports it."""
    for path in paths:
        parts = path.relative_to(ROOT).parts
        package = ".".join(parts[parts.index("src") + 1 : -1]) if "src" in parts else ""
        statements = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)]
        for name in (m for node in statements for m in _imported(node, package)):
            if name == "dart" or name.startswith("dart."):
                yield path, name


def test_what_the_model_sees_and_says_stands_on_the_contract_alone() -> None:
    # dart-policy (families and their writers, prompt formats, screen sizing, the action grammar) is shared by the
    # rollout, the trainer and the CLI's warm start: it imports no runtime and no service.
    allowed = ("dart.protocol", "dart.policy")
    sources = sorted((ROOT / "packages/dart-policy/src").rglob("*.py"))
    assert any(p.name == "action_grammar.py" for p in sources)
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path, name in _dart_imports(sources)
        if not any(name == ok or name.startswith(ok + ".") for ok in allowed)
    ]
    assert found == [], "dart-policy imports only dart.protocol:\n" + "\n".join(found)


def test_the_trainer_and_the_warm_start_import_no_rollout() -> None:
    # What they share with the rollout is dart-policy's; a test that needs an engine beside a trainer lives in
    # tests/engine_and_trainer.
    files = sorted((ROOT / "packages/dart-train").rglob("*.py"))
    files.append(ROOT / "apps/dart-cli/src/dart/cli/stack/warmstart.py")
    assert len(files) > 30 and files[-1].is_file()
    found = [
        f"{path.relative_to(ROOT)}: {name}" for path, name in _dart_imports(files) if name.startswith("dart.rollout")
    ]
    assert found == [], "dart-train and the warm start import dart-policy, not dart-rollout:\n" + "\n".join(found)
