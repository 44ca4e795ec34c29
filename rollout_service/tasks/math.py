"""Math word problems: the agent may compute with IPython (or a bash shell, when ``agent.tools`` asks
for it) and answers in ``\\boxed{}``."""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from pathlib import Path
from typing import Any

from rollout_service.schemas import ScoreResponse
from rollout_service.tasks import TaskSetup, require

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+|/[1-9]\d*)?")
_WRAPPERS = re.compile(r"^\$(.*)\$$|^\\boxed\{(.*)\}$")
SYSTEM_PROMPT = (
    "You are a careful mathematician. Use the ipython tool to compute when useful. "
    "Put the final answer in \\boxed{} and call finish with it."
)


class MathHandler:
    name = "math"
    prepares_cheaply = True
    tools = ("ipython", "finish")  # a job's tools unless its agent.tools names others
    offered = ("ipython", "bash", "finish")

    def offered_tools(self, task: dict[str, Any]) -> tuple[str, ...]:
        return self.offered

    def validate(self, task: dict[str, Any]) -> None:
        require(task, "problem", str, self.name)
        require(task, "answer", (str, int, float), self.name)

    def prepare(self, task: dict[str, Any], workspace: Path) -> TaskSetup:
        return TaskSetup(
            messages=[
                {"role": "system", "content": task.get("system_prompt", SYSTEM_PROMPT)},
                {"role": "user", "content": task["problem"]},
            ],
            tools=self.tools,
        )

    def quick_score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse | None:
        """Plain numbers compared exactly; anything else goes to math-verify in the eval stage."""
        answer = submission.get("answer")
        return plain_comparison(str(task["answer"]), None if answer is None else str(answer))

    def artifact(self, task: dict[str, Any], answer: str | None, final_text: str, execute: Any) -> dict[str, Any]:
        """The finish tool's answer, else the last ``\\boxed{}`` of the final message, else the
        last number in it (as GSM8K graders do). Never an expression found in free text:
        math-verify would evaluate a restated problem ("19 + 10 ...") and count it right, which a
        policy learns to exploit; the last number of a restatement is an operand, not the sum."""
        if answer is not None:
            return {"answer": answer}
        numbers = NUMBER.findall(final_text)
        return {"answer": last_boxed(final_text) or (numbers[-1] if numbers else None)}

    def score(self, task: dict[str, Any], submission: dict[str, Any]) -> ScoreResponse:
        from math_verify import parse, verify

        timeout_s = 5 if threading.current_thread() is threading.main_thread() else None  # signal-based
        answer = submission.get("answer")
        quick = plain_comparison(str(task["answer"]), None if answer is None else str(answer))
        if quick is not None:
            return quick
        gold = parse(f"${task['answer']}$", parsing_timeout=timeout_s)
        if answer is None or not str(answer).strip():
            return ScoreResponse(
                reward=0.0,
                details={
                    "parsed_answer": [],
                    "parsed_gold": [str(x) for x in gold],
                    "reason": "no final answer: no finish answer, and the final message has neither a \\boxed{} nor a number",
                },
            )
        answer = str(answer)
        predicted = parse(answer, parsing_timeout=timeout_s)
        correct = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=timeout_s)
        return ScoreResponse(
            reward=1.0 if correct else 0.0,
            details={"parsed_answer": [str(x) for x in predicted], "parsed_gold": [str(x) for x in gold]},
        )


def plain_number(text: str) -> str | None:
    """``text`` if it is a bare integer, decimal or fraction (optionally in ``$..$`` or
    ``\\boxed{}``), else None."""
    text = text.strip()
    while (unwrapped := _WRAPPERS.match(text)) is not None:
        text = (unwrapped.group(1) if unwrapped.group(1) is not None else unwrapped.group(2)).strip()
    return text if _PLAIN_NUMBER.fullmatch(text) else None


def plain_comparison(gold: str, answer: str | None) -> ScoreResponse | None:
    """The score without math-verify when both sides are plain numbers and the verdict is
    certain: equal values, or two different integers. math-verify parses each side with an
    ANTLR LaTeX grammar, slow next to comparing two numbers; decimals that differ go to it for its
    rounding tolerance."""
    gold_number = plain_number(gold)
    answer_number = plain_number(answer) if answer is not None else None
    if gold_number is None or answer_number is None:
        return None
    equal = Fraction(gold_number) == Fraction(answer_number)
    both_integers = not any(c in gold_number + answer_number for c in "./")
    if not equal and not both_integers:
        return None
    return ScoreResponse(
        reward=1.0 if equal else 0.0,
        details={"parsed_answer": [answer_number], "parsed_gold": [gold_number], "parsed_by": "plain_number"},
    )


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start : end + 1]
    return None
