"""The layout a reader relies on (issue #47): the tutorial at the root, the machinery in
folders that say what they are, imports that point down, code that says what and why."""
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

FOLDERS = ("kernels", "serving", "cli", "bench")
CARD = {"main.py", "gpt2.py", "utils.py", "sampling.py", "speculative.py", "kv_cache.py"}
# the model, the decoders and the kernels: they run without a command, a server or a benchmark
LESSONS = {"gpt2", "sampling", "kv_cache", "batching", "speculative", "beam_search", "cost_model", "utils",
           "checkpoint"}


def project_modules():
    """{module name: path} of every .py file but the tests'."""
    found = {name[:-3]: os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.endswith(".py")}
    for folder in FOLDERS:
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py"):
                module = folder if name == "__init__.py" else f"{folder}.{name[:-3]}"
                found[module] = os.path.join(ROOT, folder, name)
    return found


MODULES = project_modules()


def imports(path):
    """The project's modules that the file at path imports (anywhere in it)."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in out if name in MODULES}


GRAPH = {module: imports(path) - {module} for module, path in MODULES.items()}


def test_the_root_holds_the_tutorial_and_the_commands():
    root = {name for name in os.listdir(ROOT) if name.endswith(".py")}
    assert len(root) <= 12 and CARD <= root and {"server.py", "benchmark.py"} <= root, sorted(root)


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_says_what_it_is_and_names_its_way_in(folder):
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, folder, "__init__.py"), encoding="utf-8").read()))
    assert doc and len(doc.splitlines()) >= 2 and "way in" in doc


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_file_is_over_450_lines(module):
    with open(MODULES[module], encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 450


def test_no_import_circle():
    done, visiting = set(), []

    def visit(module):
        if module in visiting:
            pytest.fail("import circle: " + " -> ".join(visiting[visiting.index(module):] + [module]))
        if module in done:
            return
        visiting.append(module)
        for other in GRAPH[module]:
            visit(other)
        visiting.pop()
        done.add(module)
    for module in sorted(GRAPH):
        visit(module)


def test_arrows_point_down():
    """The model, the decoders and the kernels import no serving, benchmark or command code,
    and serving does not import main.py."""
    above = {m for m in MODULES if m.split(".")[0] in ("serving", "bench", "cli")} | {"main", "server", "benchmark"}
    for module, imported in GRAPH.items():
        if module in LESSONS or module.startswith("kernels"):
            assert not imported & above, (module, imported & above)
        if module.startswith("serving"):
            assert "main" not in imported, module


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("bench") and m != "benchmark"))
def test_product_code_names_no_cpu_model(module):
    """Which CPU measured a number is history (benchmark_results/ keeps it), not code."""
    text = open(MODULES[module], encoding="utf-8").read()
    assert not re.search(r"Zen|Xeon|EPYC|Haswell|held to AVX2", text)


@pytest.mark.parametrize("command", ["main.py", "server.py", "benchmark.py"])
def test_each_command_answers_help(command):
    done = subprocess.run([sys.executable, command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_the_model_a_reader_studies_names_no_machinery():
    """gpt2.py is the math; the kernels enter through the weights and the cache's pass."""
    with open(os.path.join(ROOT, "gpt2.py"), encoding="utf-8") as f:
        text = f.read()
    assert not [word for word in ("rowwise", "kernels", "fused", "shared") if word in text]
