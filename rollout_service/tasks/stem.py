"""Multiple-choice STEM questions (GPQA, MMLU style).

Task: ``{"question", "choices": [2..10 strings], "answer"}`` where ``answer`` is a letter
("C"), a 0-based index (2) or the text of a choice; optional ``"python": true`` offers the
ipython tool besides finish. Submission and artifact: ``{"answer"}``. The chosen letter is
read from the answer by the first rule that matches, from the most to the least explicit:
a bare letter ("C", "(C)", "C."), the exact text of a choice, ``\\boxed{C}``, an answer
phrase ("Answer: C", "the answer is (C)"), a last line that is a bare letter, the last
"(C)". Reward 1 iff that letter is the gold one; ``details`` says what was parsed and how.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rollout_service.errors import ValidationError
from rollout_service.schemas import ScoreResponse
from rollout_service.tasks import TaskSetup, require

LETTERS = "ABCDEFGHIJ"
MIN_CHOICES, MAX_CHOICES = 2, len(LETTERS)

SYSTEM_PROMPT = (
    "You answer multiple-choice science questions. Think step by step, then call finish with "
    'the letter of the correct choice as the answer, e.g. {"answer": "C"}.'
)

_BARE = re.compile(r"[(\[]?\s*([A-Ja-j])\s*[)\].:]?")
_BOXED = re.compile(r"\\boxed\s*\{\s*(?:\\(?:text|textbf|mathrm|mathbf)\s*\{)?\s*\(?\s*([A-J])(?![A-Za-z])")
_PHRASE = re.compile(
    r"(?i:\b(?:answer|correct\s+(?:option|choice)))"
    r"\s*(?:is|would\s+be|should\s+be|:)?\s*[:\-]?\s*(?:\*\*|\$)?\s*[(\[]?\s*([A-J])(?![A-Za-z])"
)
_PARENTHESIZED = re.compile(r"\(([A-J])\)")


def _normalize(text: str) -> str:
    return " ".join(text.strip().rstrip(".").split()).casefold()


def parse_choice(text: str, choices: list[str]) -> tuple[str | None, str]:
    """The letter chosen in ``text`` and the rule that found it, or (None, "none")."""
    stripped = text.strip()
    bare = _BARE.fullmatch(stripped)
    if bare:
        return bare.group(1).upper(), "bare_letter"
    normalized = _normalize(stripped)
    for index, choice in enumerate(choices):
        if normalized and normalized == _normalize(choice):
            return LETTERS[index], "choice_text"
    for rule, pattern in (("boxed", _BOXED), ("answer_phrase", _PHRASE)):
        found = pattern.findall(stripped)
        if found:
            return found[-1].upper(), rule
    lines = [line for line in stripped.splitlines() if line.strip()]
    if lines:
        last = _BARE.fullmatch(lines[-1].strip().strip("*"))
        if last:
            return last.group(1).upper(), "last_line"
    found = _PARENTHESIZED.findall(stripped)
    if found:
        return found[-1], "parenthesized"
    return None, "none"


def gold_letter(task: dict[str, Any]) -> str:
    """The gold answer as a letter; raises ValidationError when it names no choice."""
    answer, choices = task["answer"], [str(c) for c in task["choices"]]
    if isinstance(answer, int) and not isinstance(answer, bool):
        if 0 <= answer < len(choices):
            return LETTERS[answer]
        raise ValidationError(
            f"task.answer index {answer} is out of range: use 0..{len(choices) - 1} (0-based) or a letter"
        )
    text = str(answer).strip()
    if len(text) == 1 and text.upper() in LETTERS[: len(choices)]:
        return text.upper()
    for index, choice in enumerate(choices):
        if _normalize(choice) == _normalize(text):
            return LETTERS[index]
    raise ValidationError(
        f"task.answer {answer!r} names no choice: use a letter A-{LETTERS[len(choices) - 1]}, "
        "a 0-based index, or the exact text of a choice"
    )


class StemHandler:
    name = "stem"
    prepares_cheaply = True

    def validate(self, task: dict[str, Any]) -> None:
        require(task, "question", str, self.name)
        choices = require(task, "choices", list, self.name)
        if not MIN_CHOICES <= len(choices) <= MAX_CHOICES:
            raise ValidationError(f"task.choices must have {MIN_CHOICES} to {MAX_CHOICES} options, got {len(choices)}")
        if not all(isinstance(c, (str, int, float)) and not isinstance(c, bool) for c in choices):
            raise ValidationError("task.choices must be a list of strings (the option texts, without letters)")
        require(task, "answer", (str, int), self.name)
        gold_letter(task)
        if not isinstance(task.get("python", False), bool):
            raise ValidationError("task.python must be true or false (true offers the ipython tool)")

    def offered_tools(self, task: dict[str, Any]) -> tuple[str, ...]:
        return ("ipython", "finish") if task.get("python") else ("finish",)

    def prepare(self, task: dict[str, Any], workspace: Path) -> TaskSetup:
        options = "\n".join(f"{LETTERS[i]}. {choice}" for i, choice in enumerate(task["choices"]))
        user = f"{task['question'].strip()}\n\n{options}"
        return TaskSetup(
            messages=[
                {"role": "system", "content": task.get("system_prompt", SYSTEM_PROMPT)},
                {"role": "user", "content": user},
            ],
            tools=self.offered_tools(task),
            finish_hint="\n\nCall finish with the letter of the correct choice.",
        )

    def artifact(self, task: dict[str, Any], answer: str | None, final_text: str, execute: Any) -> dict[str, Any]:
        return {"answer": answer if answer is not None else final_text}

    def quick_score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse | None:
        return self.score(task, submission)  # a letter matched by a few regular expressions

    def score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse:
        choices = [str(c) for c in task["choices"]]
        gold = gold_letter(task)
        parsed, rule = parse_choice(str(submission.get("answer") or ""), choices)
        return ScoreResponse(
            reward=1.0 if parsed == gold else 0.0, details={"parsed_answer": parsed, "parsed_by": rule, "gold": gold}
        )
