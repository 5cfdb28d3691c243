"""Rules the test suite keeps about itself (docs/testing.md):
- test modules never import one another: what two of them share lives in tests/helpers.py or the other shared
  modules (cli_helpers, multirank, processes, slurm_jobs, workers/);
- every test that starts ranks or processes through the shared starters (multirank, processes, slurm_jobs) or
  runs on the SLURM cluster is marked `slow`, so `-m "not slow"` stays the fast tier;
- every test module keeps at least one test in the fast tier (not marked slow), so `-m "not slow"` covers every
  module at unit level; the deliberate exceptions are listed, each with its reason (ALL_SLOW);
- every test asserts something: an `assert`, `pytest.raises`/`warns`/`fail`, or a call of an `assert_*` helper,
  in its body or in a function of its module that it calls (a test that only runs code passes whatever it does).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# The modules whose functions start ranks, torchrun or SLURM jobs, and the fixture that starts a SLURM cluster.
STARTERS = {"multirank", "processes", "slurm_jobs"}
STARTING_FIXTURES = {"slurm_cluster"}


def _imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_test_modules_never_import_one_another() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for module in _imported_modules(ast.parse(path.read_text())):
            if module.split(".")[-1].startswith("test_"):
                offenders.append(f"{path.relative_to(TESTS)} imports {module}")
    assert offenders == []


def _is_slow(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d) == "pytest.mark.slow" for d in decorators)


def _module_is_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return "pytest.mark.slow" in ast.unparse(node.value)
    return False


def starting_tests_not_marked_slow(tree: ast.Module) -> list[str]:
    """The test functions of `tree` that call a starter (directly, through a function of the same module, or
    through a fixture of the same module) or take a starting fixture, and are not marked slow."""
    starters = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module in STARTERS for alias in node.names}
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def starts(name: str, seen: frozenset[str] = frozenset()) -> bool:
        function = functions.get(name)
        if function is None or name in seen:
            return False
        seen = seen | {name}
        arguments = {a.arg for a in function.args.args}
        if arguments & STARTING_FIXTURES or any(starts(a, seen) for a in arguments):
            return True
        called = {node.func.id for node in ast.walk(function)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        return bool(called & starters) or any(starts(c, seen) for c in called)

    if _module_is_slow(tree):
        return []
    return [name for name, function in functions.items()
            if name.startswith("test_") and starts(name) and not _is_slow(function.decorator_list)]


def test_every_test_that_starts_ranks_or_jobs_is_marked_slow() -> None:
    offenders = {path.name: found for path in sorted(TESTS.glob("test_*.py"))
                 if (found := starting_tests_not_marked_slow(ast.parse(path.read_text())))}
    assert offenders == {}


def test_the_slow_rule_sees_a_starter_behind_a_helper_and_a_fixture() -> None:
    """The rule itself: an unmarked test reaching run_ranks through a module function, or through a fixture, is
    found; the same tests marked slow, or a module marked slow, pass."""
    source = '''
import pytest
from multirank import run_ranks

@pytest.fixture
def job(tmp_path):
    return run_ranks("w", 2, {}, tmp_path)

def helper(tmp_path):
    return run_ranks("w", 2, {}, tmp_path)

def test_direct(tmp_path):
    run_ranks("w", 2, {}, tmp_path)

def test_through_helper(tmp_path):
    helper(tmp_path)

def test_through_fixture(job):
    assert job

def test_on_slurm(slurm_cluster):
    assert slurm_cluster

def test_unit():
    assert 1
'''
    found = starting_tests_not_marked_slow(ast.parse(source))
    assert found == ["test_direct", "test_through_helper", "test_through_fixture", "test_on_slurm"]
    marked = source.replace("\ndef test_", "\n@pytest.mark.slow\ndef test_")
    assert starting_tests_not_marked_slow(ast.parse(marked)) == []
    assert starting_tests_not_marked_slow(ast.parse(source + "\npytestmark = pytest.mark.slow\n")) == []


# Test modules with no fast test, by design: each is the multi-rank, multi-process or SLURM proof of code whose
# unit level other modules' fast tests cover (named in the reason).
SLURM = ("a real SLURM cluster (tests/slurm_cluster.py) runs every test; the sbatch script, the submission and the "
         "run folder are test_launch's and test_submit_failures' fast tests, the trainer's stop and resume "
         "test_train_resume's")
ALL_SLOW: dict[str, str] = {
    "test_data_parallel.py": "FSDP2 layouts against the single process, each a gloo job; FSDP2 in one bf16 process "
                             "is test_chunked_loss's fast test, the dp checks test_hsdp's and test_fsdp_cadence's",
    "test_fp8_layouts.py": "fp8 under the parallel layouts, one gloo job; fp8 itself is test_fp8's, "
                           "test_fp8_kernels' and test_fp8_saved_inputs' fast tests",
    "test_glm_layouts.py": "glm4-moe-tiny under the parallel layouts, one gloo job; the family itself is test_hf's, "
                           "test_plan_measure's and test_config's fast tests",
    "test_gpt_oss_layouts.py": "gpt-oss-tiny under TP2+SP, TP2, EP2, PP2, DP2, CP2 (both exchanges), ETP2, one "
                                "gloo job; the family itself is test_hf's, test_plan_measure's and test_config's "
                                "fast tests",
    "test_muon_layouts.py": "Muon under the parallel layouts, one gloo job; Muon itself is test_muon's fast tests",
    "test_offload_layouts.py": "activation offloading under the parallel layouts, one gloo job; the pool and every "
                               "region are test_offload's fast tests, the planned bytes test_plan_measure's",
    "test_processes.py": "proves tests/processes.py's kill of a real launcher's process tree (test infrastructure, "
                         "no moe_train code)",
    "test_resilience.py": "one 4-rank job; resume, rejected steps and the notice file in one process are "
                          "test_checkpoint's, test_bad_steps' and test_train_resume's fast tests",
    "test_split_wgrad_plan.py": "one 2-rank gloo job, plain and split_wgrad measured against the plan's two ends; "
                                "the plan's split_wgrad pricing is test_plan_overlap's fast tests",
    "test_stop_one_rank.py": "signals one of two torchrun ranks; a single process's stop and a rank's failure are "
                             "test_train_resume's and test_run_cli's fast tests",
    "test_slurm.py": SLURM,
    "test_slurm_resilience.py": SLURM,
    "test_slurm_two_nodes.py": SLURM,
}


def has_a_fast_test(tree: ast.Module) -> bool:
    """Whether `tree` holds a test function that `-m "not slow"` runs: not marked slow itself nor by the
    module's `pytestmark`. A parametrised test counts (fast_sample keeps its first case fast)."""
    return not _module_is_slow(tree) and any(
        isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and not _is_slow(node.decorator_list)
        for node in tree.body)


def test_every_test_module_keeps_a_fast_test() -> None:
    without = sorted(path.name for path in TESTS.glob("test_*.py") if not has_a_fast_test(ast.parse(path.read_text())))
    assert without == sorted(ALL_SLOW), "modules with no fast test (give each a unit test, or list it in ALL_SLOW)"
    assert all(ALL_SLOW.values())  # each exception says why
    # The rule itself: a module whose tests are all marked slow, or that is marked slow, has none; one unmarked
    # test is enough.
    slow = "import pytest\n\n@pytest.mark.slow\ndef test_a():\n    assert 1\n"
    assert not has_a_fast_test(ast.parse(slow))
    assert not has_a_fast_test(ast.parse(slow.replace("@pytest.mark.slow\n", "") + "\npytestmark = pytest.mark.slow\n"))
    assert has_a_fast_test(ast.parse(slow + "\ndef test_b():\n    assert 1\n"))


def _checks(function: ast.FunctionDef, functions: dict[str, ast.FunctionDef], seen: frozenset[str]) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name.startswith("assert") or name in ("raises", "warns", "fail"):
                return True
            if name in functions and name not in seen and _checks(functions[name], functions, seen | {name}):
                return True
    return False


def unasserting_tests(tree: ast.Module) -> list[str]:
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    return [name for name, function in functions.items()
            if name.startswith("test_") and not _checks(function, functions, frozenset({name}))]


def test_every_test_asserts_something() -> None:
    offenders = {path.name: found for path in sorted(TESTS.glob("test_*.py"))
                 if (found := unasserting_tests(ast.parse(path.read_text())))}
    assert offenders == {}
    # The rule itself: a test that only loads a recipe is found; one whose helper asserts is not.
    source = "def helper():\n    assert 1\n\ndef test_a():\n    load()\n\ndef test_b():\n    helper()\n"
    assert unasserting_tests(ast.parse(source)) == ["test_a"]
