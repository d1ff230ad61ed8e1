"""The README keeps its promises where a machine can check them: its commands parse, the
flags it names exist, the files and links it points at are there, and it stays short."""
import os
import re
import shlex

import pytest

import benchmark
import main
from conftest import ROOT
from kernels import rowwise
from serving import server

PAGES = ["README.md", os.path.join("benchmark_results", "README.md"), os.path.join("benchmark_results", "earlier", "README.md")]
PARSERS = {"main.py": main.parse_args, "server.py": server.parse_args, "benchmark.py": benchmark.parse_args}


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def commands(text):
    """(script, argv) of every `python <script>.py ...` line inside a fenced code block."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"(?:.*&& )?python (\w+\.py)(.*)", line.split(" # ")[0].strip())
        if fenced and m and m.group(1) in PARSERS:
            found.append((m.group(1), shlex.split(m.group(2))))
    return found


def test_the_readme_is_read_in_one_sitting():
    assert len(read("README.md").encode()) <= 12 * 1024
    assert len(read(os.path.join("benchmark_results", "README.md")).encode()) <= 12 * 1024  # an index, not a journal


NARROW = {"bfloat16", "int8", "int4"}  # weight formats only the numba kernel runs


@pytest.mark.parametrize("page", PAGES)
def test_every_command_in_a_code_block_parses(page):
    found = commands(read(page))
    assert page != "README.md" or {script for script, _ in found} == set(PARSERS)
    for script, argv in found:
        if script == "benchmark.py" and rowwise.KERNEL != "numba" and NARROW & set(argv):
            continue  # the benchmark refuses narrow weights where the numba kernel does not run
        PARSERS[script](argv)  # a flag that does not exist raises (main, server) or exits (benchmark)


# flags of the programs the README compares ours with (vLLM, llama.cpp's server, uvicorn)
OTHERS = {"max-num-seqs", "max-model-len", "ctx-size", "parallel", "timeout", "workers"}


def flags_of(parse_args, capsys):
    """The flags a command's --help lists."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    return set(re.findall(r"(?<![\w-])--([A-Za-z][A-Za-z_]*)", capsys.readouterr().out))


def test_every_flag_the_readme_names_exists(capsys):
    flags = set(re.findall(r"(?<![\w-])--([a-z][A-Za-z_-]*[A-Za-z_])", read("README.md"))) - OTHERS
    known = set().union(*(flags_of(parse_args, capsys) for parse_args in PARSERS.values()))
    assert flags and flags <= known, flags - known


@pytest.mark.parametrize("page", PAGES)
def test_every_link_and_file_it_names_exists(page):
    text, here = read(page), os.path.dirname(os.path.join(ROOT, page))
    links = [t for t in re.findall(r"\]\(([^)#]+)\)", text) if not t.startswith("http")]
    files = re.findall(r"(?<![\w/.-])([\w/-]+\.(?:py|png|svg|md|txt))\b", text) if page == "README.md" else []
    assert links
    for target in links:
        assert os.path.exists(os.path.join(here, target)), target
    for name in files:  # at the root or in one of the project's folders
        if name not in ("prompts.txt",):  # the reader's own file in an example
            assert any(os.path.exists(os.path.join(ROOT, folder, name))
                       for folder in ("", "kernels", "serving", "cli", "bench")), name


def test_the_readme_states_what_the_code_does_now():
    text = read("README.md").lower()
    for history in ("this session", "issue ", "previous version", "earlier version", "before the restructuring"):
        assert history not in text


def kept_runs():
    """(results.md, the command atop it) of every kept benchmark run."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "benchmark_results")):
        if "results.md" in files:
            text = read(os.path.relpath(os.path.join(folder, "results.md"), ROOT))
            m = re.search(r"^Command: `python (\w+\.py)(.*?)`", text, re.M)
            found.append((os.path.relpath(folder, ROOT), m and (m.group(1), shlex.split(m.group(2)))))
    return found


def test_every_kept_run_is_in_an_index():
    """A run no index links is a result no reader finds: each results.md is linked from
    benchmark_results/README.md or from the README of a folder above it."""
    for run, _ in kept_runs():
        linked = [page for page in PAGES[1:] if run.startswith(os.path.dirname(page) + os.sep)
                  and f"]({os.path.relpath(run, os.path.dirname(page))}/results.md)" in read(page)]
        assert linked, f"{run}/results.md is linked from no index"


@pytest.mark.parametrize("run, command", kept_runs())
def test_the_command_atop_every_kept_run_parses(run, command):
    """No kept result becomes unreproducible: the command it prints still parses."""
    if command is None:
        pytest.skip(f"{run}/results.md prints no command line")
    script, argv = command
    if rowwise.KERNEL != "numba" and NARROW & set(argv):
        pytest.skip("its narrow weights need the numba kernel, which this machine does not run")
    PARSERS[script](argv)
