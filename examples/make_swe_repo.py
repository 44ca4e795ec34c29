"""Create the example SWE-style repository: a small date library whose leap-year rule is wrong.

    python examples/make_swe_repo.py /tmp/rollout-swe-example            # prints the task as JSON
    python examples/make_swe_repo.py /tmp/rollout-swe-example --force    # recreate it

History (fixed authors and dates, so commit ids are the same on every machine):
  1. "Add leap years and month lengths"      is_leap_year ignores the 100/400 rule (the bug)
  2. "Add day_of_year"                       <- base_commit
  3. "Leap years: apply the century rule"    the fix and its tests (the gold patch and test_patch)
The printed task is a SWE-bench instance (with the gold ``patch``) whose ``repo_path`` is the
directory; agents only ever see the history up to base_commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

INSTANCE_ID = "example__dates-1"
TEST_FILE = "tests/test_calendar.py"
FAIL_TO_PASS = [
    f"{TEST_FILE}::test_century_years_are_leap_only_when_divisible_by_400",
    f"{TEST_FILE}::test_february_1900_has_28_days",
]
PASS_TO_PASS = [
    f"{TEST_FILE}::test_years_divisible_by_four_are_leap",
    f"{TEST_FILE}::test_month_lengths",
    f"{TEST_FILE}::test_day_of_year",
]
PROBLEM_STATEMENT = """\
is_leap_year(1900) returns True, but 1900 was not a leap year

In the Gregorian calendar a year divisible by 100 is a leap year only if it is also divisible
by 400: 2000 was a leap year, 1900 and 2100 are not. `dates.is_leap_year(1900)` returns True,
and so `dates.days_in_month(1900, 2)` returns 29 instead of 28.
"""

BUGGY = '''"""Gregorian calendar helpers."""


def is_leap_year(year: int) -> bool:
    """True when ``year`` has a 29th of February."""
    return year % 4 == 0


def days_in_month(year: int, month: int) -> int:
    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1..12, got {month}")
    if month == 2:
        return 29 if is_leap_year(year) else 28
    return 30 if month in (4, 6, 9, 11) else 31
'''
DAY_OF_YEAR = '''

def day_of_year(year: int, month: int, day: int) -> int:
    """1 for the 1st of January, 365 or 366 for the 31st of December."""
    return sum(days_in_month(year, m) for m in range(1, month)) + day
'''
FIXED_RULE = """    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
"""
TESTS = """from dates import days_in_month, is_leap_year


def test_years_divisible_by_four_are_leap():
    assert is_leap_year(2024)
    assert not is_leap_year(2023)


def test_month_lengths():
    assert days_in_month(2024, 2) == 29
    assert days_in_month(2023, 2) == 28
    assert days_in_month(2023, 4) == 30
    assert days_in_month(2023, 12) == 31
"""
DAY_OF_YEAR_TEST = """

def test_day_of_year():
    from dates import day_of_year

    assert day_of_year(2023, 1, 1) == 1
    assert day_of_year(2023, 12, 31) == 365
    assert day_of_year(2024, 12, 31) == 366
"""
CENTURY_TESTS = """

def test_century_years_are_leap_only_when_divisible_by_400():
    assert is_leap_year(2000)
    assert not is_leap_year(1900)
    assert not is_leap_year(2100)


def test_february_1900_has_28_days():
    assert days_in_month(1900, 2) == 28
"""


def git(repo: Path, *args: str, date: str = "2024-01-01T12:00:00+00:00") -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_DATE": date,
        "GIT_AUTHOR_NAME": "Example Author",
        "GIT_AUTHOR_EMAIL": "author@example.invalid",
        "GIT_COMMITTER_NAME": "Example Author",
        "GIT_COMMITTER_EMAIL": "author@example.invalid",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }
    return subprocess.run(
        ["git", "-c", "core.hooksPath=/dev/null", "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args],
        cwd=repo,
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout


def commit(repo: Path, files: dict[str, str], message: str, day: int) -> str:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o644)
        git(repo, "add", name)
    git(repo, "commit", "-q", "-m", message, date=f"2024-01-{day:02d}T12:00:00+00:00")
    return git(repo, "rev-parse", "HEAD").strip()


def make_repo(directory: Path, force: bool = False) -> dict:
    """Create the repository in ``directory`` and return its SWE-bench task."""
    directory = directory.resolve()
    if directory.exists() and any(directory.iterdir()):
        if not force:
            raise SystemExit(f"{directory} is not empty; pass --force to recreate it")
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    git(directory, "init", "-q", "-b", "main")
    commit(
        directory,
        {
            ".gitignore": "__pycache__/\n*.pyc\n.pytest_cache/\n",
            "README.md": "# dates\n\nGregorian calendar helpers.\n",
            "pytest.ini": "[pytest]\ntestpaths = tests\n",
            "dates/__init__.py": "from dates.calendar import days_in_month, is_leap_year\n",
            "dates/calendar.py": BUGGY,
            TEST_FILE: TESTS,
        },
        "Add leap years and month lengths",
        1,
    )
    base = commit(
        directory,
        {
            "dates/__init__.py": "from dates.calendar import day_of_year, days_in_month, is_leap_year\n",
            "dates/calendar.py": BUGGY + DAY_OF_YEAR,
            TEST_FILE: TESTS + DAY_OF_YEAR_TEST,
        },
        "Add day_of_year",
        2,
    )
    fixed = commit(
        directory,
        {
            "dates/calendar.py": (BUGGY + DAY_OF_YEAR).replace("    return year % 4 == 0\n", FIXED_RULE),
            TEST_FILE: TESTS + DAY_OF_YEAR_TEST + CENTURY_TESTS,
        },
        "Leap years: apply the century rule",
        3,
    )
    return {
        "domain": "swe",
        "instance_id": INSTANCE_ID,
        "repo_path": str(directory),
        "base_commit": base,
        "problem_statement": PROBLEM_STATEMENT,
        "patch": git(directory, "diff", base, fixed, "--", "dates"),
        "test_patch": git(directory, "diff", base, fixed, "--", "tests"),
        "FAIL_TO_PASS": json.dumps(FAIL_TO_PASS),
        "PASS_TO_PASS": json.dumps(PASS_TO_PASS),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, nargs="?", default=Path("/tmp/rollout-swe-example"))
    parser.add_argument("--force", action="store_true", help="delete and recreate a non-empty directory")
    args = parser.parse_args(argv)
    print(json.dumps(make_repo(args.directory, args.force)))


if __name__ == "__main__":
    main(sys.argv[1:])
