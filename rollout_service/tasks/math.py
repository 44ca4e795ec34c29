"""Math word problems: the agent may compute with IPython and answers in ``\\boxed{}``."""
from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Optional

from rollout_service.schemas import ScoreResponse
from rollout_service.tasks import Prepared, require

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
SYSTEM_PROMPT = (
    "You are a careful mathematician. Use the ipython tool to compute when useful. "
    "Put the final answer in \\boxed{} and call finish with it."
)


class MathHandler:
    name = "math"
    tools = ("ipython", "finish")

    def offered_tools(self, task: dict[str, Any]) -> tuple[str, ...]:
        return self.tools

    def validate(self, task: dict[str, Any]) -> None:
        require(task, "problem", str, self.name)
        require(task, "answer", (str, int, float), self.name)

    def prepare(self, task: dict[str, Any], workspace: Path) -> Prepared:
        return Prepared(
            messages=[{"role": "system", "content": task.get("system_prompt", SYSTEM_PROMPT)},
                      {"role": "user", "content": task["problem"]}],
            tools=self.tools,
        )

    def artifact(self, task: dict[str, Any], answer: Optional[str], final_text: str,
                 execute: Any) -> dict[str, Any]:
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
        gold = parse(f"${task['answer']}$", parsing_timeout=timeout_s)
        if answer is None or not str(answer).strip():
            return ScoreResponse(reward=0.0, details={
                "parsed_answer": [], "parsed_gold": [str(x) for x in gold],
                "reason": "no final answer: no finish answer, and the final message has neither a \\boxed{} nor a number"})
        answer = str(answer)
        predicted = parse(answer, parsing_timeout=timeout_s)
        correct = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=timeout_s)
        return ScoreResponse(reward=1.0 if correct else 0.0, details={
            "parsed_answer": [str(x) for x in predicted], "parsed_gold": [str(x) for x in gold]})


def last_boxed(text: str) -> Optional[str]:
    """The last ``\\boxed{...}`` of ``text`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end + 1]
    return None
