"""Mutation check of the losslessness tests (not in CI): does the CPU suite catch subtle errors?

Each mutant is a source patch (exact text to find, its replacement) with a one-line description. The
tool copies the working tree to a temporary directory, applies one mutant there (the real files are
never edited), and runs each test that should catch it in a subprocess over the seeds (DSPARK_TEST_SEED
as a range: a test taking the rng_seed fixture runs once per seed), then prints one row per mutant and
test: the seeds in which the test failed. A patch whose text is not found exactly once stops the tool
with its name (the code has moved: update the patch). --baseline runs the same tests on the unmutated
copy first: they must pass in every seed.

    python -m bench.mutants [--seeds 20] [--mutants rho support ...] [--tests test_verify ...]
                            [--skip-tests engine ...] [--baseline] [--out table.md]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "runs", "*.pt")

DECISIONS = "tests/test_verify_reference.py::test_op_emits_the_references_tokens"
OP_LAW = "tests/test_verify.py::test_op_is_lossless"
DECODER = "tests/test_decoder.py::test_lossless_joint_law_of_first_three_tokens"
ENGINE = "tests/test_engine_lossless.py::test_served_requests_follow_the_target"


@dataclass
class Mutant:
    name: str
    description: str
    patches: list[tuple[str, str, str]]  # (path, text, replacement)
    tests: list[tuple[str, str]]  # (test node id, -k expression selecting its cases; "" for all)


MUTANTS = [
    Mutant("rho", "block verification's residual without rho_tau: max(p - q, 0)",
           [("dspark/ops/verify.py", "scale = torch.where(n < K, rho.gather(1, n[:, None]).squeeze(1), 1.0)",
             "scale = torch.ones_like(temperature)")],
           [(DECISIONS, "block-temperature"), (OP_LAW, "block-0.7")]),
    Mutant("support", "the residual restricted to q's support (tokens the drafter never proposes are never "
                      "corrected to)",
           [("dspark/ops/verify.py", "residual = (scale[:, None] * p_row - q_row).clamp(min=0.0)",
             "residual = torch.where(q_row > 0, scale[:, None] * p_row - q_row, 0.0).clamp(min=0.0)")],
           [(DECISIONS, "standard-temperature"), (OP_LAW, "standard-1.0")]),
    Mutant("bonus-for-residual", "the correction drawn from p (the bonus's law) where the residual is due",
           [("dspark/ops/verify.py", "q_row = F.pad(proposals, (0, 0, 0, 1)).gather(1, row).squeeze(1)",
             "q_row = torch.zeros_like(p_row)")],
           [(DECISIONS, "standard-temperature"), (OP_LAW, "standard-1.0")]),
    Mutant("residual-for-bonus", "a residual taken at the bonus position, against the last proposal",
           [("dspark/ops/verify.py", "q_row = F.pad(proposals, (0, 0, 0, 1)).gather(1, row).squeeze(1)",
             "q_row = torch.cat([proposals, proposals[:, -1:]], 1).gather(1, row).squeeze(1)")],
           [(DECISIONS, "standard-temperature"), (OP_LAW, "standard-1.0")]),
    Mutant("uniform-key", "the acceptance uniform keyed one draft position off (the law stays the target's: "
                          "the uniforms stay independent)",
           [("dspark/ops/verify.py", "STREAM_ACCEPT + position)", "STREAM_ACCEPT + position + 1)")],
           [(DECISIONS, "standard-temperature"), (OP_LAW, "standard-1.0")]),
    Mutant("proposal-temperature", "the proposal written at T = 1 while the draft is drawn at T",
           [("dspark/ops/gumbel_pick.py", "q = torch.exp(x - m_all) * (1.0 / mass.sum(-1, keepdim=True))",
             "q = torch.softmax(position_logits(logits, bias, k), -1)")],
           [("tests/test_markov_drafting.py::test_stored_proposals_are_the_drawn_distributions", ""),
            (DECODER, "standard-0.7"), (ENGINE, "")]),
    Mutant("noise-reuse", "a step's verification keyed by the position before its anchor: the noise of the "
                          "step before (or of the prefill) is drawn again when that step accepted no draft",
           [("dspark/decoder.py", "draft_probs, sampling, start)\n        if self.forced_num_accepted is not None:",
             "draft_probs, sampling, start - 1)\n        if self.forced_num_accepted is not None:")],
           [(DECODER, "standard-1.0-1.0-1"), (ENGINE, "")]),
    Mutant("top-p-on-drafts", "top-p applied to the drafter's logits instead of the target's (the prefill's "
                              "first token keeps it)",
           [("dspark/decoder.py", "        if sampling.uses_filters:\n            logits = apply_filters(",
             "        if sampling.uses_filters and drafts.shape[1] == 0:\n            logits = apply_filters("),
            ("dspark/decoder.py", "        if sampling.all_greedy:\n            return greedy_draft(",
             "        if sampling.uses_filters:\n            base_logits = apply_filters(base_logits.float(), "
             "sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)\n"
             "        if sampling.all_greedy:\n            return greedy_draft(")],
           [(DECODER, "standard-0.7"), (ENGINE, "")]),
]


def apply(mutant: Mutant, tree: Path) -> None:
    """Applies the mutant's patches in `tree`; stops naming the patch whose text is not there once."""
    for path, text, replacement in mutant.patches:
        source = (tree / path).read_text()
        if source.count(text) != 1:
            sys.exit(f"mutant {mutant.name}: the text to patch is found {source.count(text)} times in {path} "
                     f"(expected once): {text!r}")
        (tree / path).write_text(source.replace(text, replacement))


def run_test(tree: Path, test: str, select: str, seeds: int) -> tuple[int, int]:
    """Runs one test over seeds 0 .. seeds-1 in `tree` -> (seeds in which it failed, seeds it ran; a test
    that takes no seed runs once)."""
    report = tree / "report.xml"
    command = [sys.executable, "-m", "pytest", test, "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
               f"--junitxml={report}"] + (["-k", select] if select else [])
    env = {**os.environ, "DSPARK_TEST_SEED": f"0-{seeds - 1}", "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1) or not report.exists():
        sys.exit(f"{test} -k {select!r} did not run (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    failed, ran = set(), set()
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        seed = re.search(r"seed(\d+)", case.get("name"))  # none: the test draws nothing at random
        seed = seed.group(1) if seed else "none"
        ran.add(seed)
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(seed)
    report.unlink()
    return len(failed), len(ran)


def check_imports_the_copy(tree: Path) -> None:
    """The subprocesses must import dspark from the copy, not the editable install of the real tree."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    where = subprocess.run([sys.executable, "-c", "import dspark; print(dspark.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(tree)):
        sys.exit(f"the copy imports dspark from {where}, not from {tree}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--mutants", nargs="*", default=[m.name for m in MUTANTS],
                        choices=[m.name for m in MUTANTS])
    parser.add_argument("--tests", nargs="*", default=[""], help="run only the tests whose id holds one of these")
    parser.add_argument("--skip-tests", nargs="*", default=[], help="skip the tests whose id holds one of these")
    parser.add_argument("--baseline", action="store_true", help="run the tests on the unmutated tree first")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if m.name in args.mutants]
    for mutant in chosen:
        mutant.tests = [(test, select) for test, select in mutant.tests if any(t in test for t in args.tests)
                        and not any(t in test for t in args.skip_tests)]
    rows = ["| mutant | test | cases | caught / seeds |", "|---|---|---|---|"]

    def emit(row: str) -> None:
        rows.append(row)
        print(row, flush=True)
        if args.out:
            Path(args.out).write_text("\n".join(rows) + "\n")

    print("\n".join(rows), flush=True)
    with tempfile.TemporaryDirectory(prefix="dspark-mutants-") as scratch:
        if args.baseline:
            tree = Path(shutil.copytree(ROOT, Path(scratch) / "baseline", ignore=COPY_IGNORE))
            check_imports_the_copy(tree)
            for test, select in dict.fromkeys(t for m in chosen for t in m.tests):
                failed, ran = run_test(tree, test, select, args.seeds)
                emit(f"| (none: baseline) | {test.split('::')[1]} | {select or 'all'} | {failed} / {ran} |")
        for mutant in chosen:
            tree = Path(shutil.copytree(ROOT, Path(scratch) / mutant.name, ignore=COPY_IGNORE))
            apply(mutant, tree)
            check_imports_the_copy(tree)
            for test, select in mutant.tests:
                failed, ran = run_test(tree, test, select, args.seeds)
                emit(f"| {mutant.name}: {mutant.description} | {test.split('::')[1]} | {select or 'all'} | "
                     f"{failed} / {ran} |")
            shutil.rmtree(tree)


if __name__ == "__main__":
    main()
