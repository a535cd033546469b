"""The prompt and feedback format: one module for the trainer, the distiller, the model
bootstrap and the sandbox's code extraction, so the warm start and training see the same
dialogue.

A dialogue is a list of `ChatMessage`s:

    user:       task_prompt(task, toolchain)         the statement and the entry point
    assistant:  the model's answer, one fenced code block
    user:       feedback(verdict)                    compiler errors, mismatch, crash or speed
    assistant:  the next attempt
    ...

Keep prompts short: the embedded default model has a small context, and every token of a
prompt is paid for on every turn.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2

Stage = common_pb2.Stage
Toolchain = common_pb2.Toolchain
ChatMessage = common_pb2.ChatMessage

FENCE_LANGUAGE = {
    Toolchain.TOOLCHAIN_CPU: "cpp",
    Toolchain.TOOLCHAIN_CUDA: "cuda",
    Toolchain.TOOLCHAIN_KERNELBENCH: "python",
}
TOOLCHAIN_WORDS = {
    Toolchain.TOOLCHAIN_CPU: "a C++17 function (OpenMP allowed)",
    Toolchain.TOOLCHAIN_CUDA: "a CUDA kernel and its extern \"C\" host launcher",
    Toolchain.TOOLCHAIN_KERNELBENCH: "a PyTorch module ModelNew with custom kernels",
}
FEEDBACK_MAX_CHARS = 400

# A chat template for models without one (the embedded default model uses it). Nothing
# follows <|end|>, so a sampled answer ending in <|end|> plus continuation_text() is token for
# token what the template renders for the whole dialogue.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
END_OF_TURN = "<|end|>"


def user(content: str) -> ChatMessage:
    return ChatMessage(role="user", content=content)


def assistant(content: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=content)


def task_prompt(task: sandbox_pb2.Task, toolchain: int = Toolchain.TOOLCHAIN_CPU) -> str:
    """The first user message for a task."""
    fence = FENCE_LANGUAGE[toolchain]
    lines = [f"Task {task.id}: {task.title}.", task.statement.strip()]
    if toolchain == Toolchain.TOOLCHAIN_KERNELBENCH:
        lines += ["Reference:", f"```python\n{task.reference_source.strip()}\n```"]
        lines.append(f"Write {TOOLCHAIN_WORDS[toolchain]}, in one ```{fence} block.")
    else:
        lines.append(f"Write {TOOLCHAIN_WORDS[toolchain]} defining:")
        lines.append(task.entry_point.c_declaration.strip())
        lines.append(f"Answer with one ```{fence} block.")
    return "\n".join(line for line in lines if line)


def first_turn(task: sandbox_pb2.Task, toolchain: int = Toolchain.TOOLCHAIN_CPU) -> list[ChatMessage]:
    return [user(task_prompt(task, toolchain))]


def answer(code: str, toolchain: int = Toolchain.TOOLCHAIN_CPU) -> str:
    """An assistant message holding `code` the way the model is taught to answer."""
    return f"```{FENCE_LANGUAGE[toolchain]}\n{code.strip()}\n```"


def _trim(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 4].rstrip() + " ..."


def first_errors(log: str, limit: int = FEEDBACK_MAX_CHARS) -> str:
    """The first error lines of a compiler log (where the useful information is)."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return _trim("\n".join(errors[:3] or lines[:3]), limit)


def feedback(verdict: sandbox_pb2.Verdict, limit: int = FEEDBACK_MAX_CHARS) -> str:
    """The user message answering a verdict: what went wrong (or how fast it was) and what to do."""
    stage = verdict.stage
    if stage == Stage.STAGE_FORMAT:
        text = f"No usable code block: {verdict.message or 'answer with one fenced code block'}."
    elif stage == Stage.STAGE_COMPILE:
        text = "Compilation failed:\n" + first_errors(verdict.compile.log or verdict.message, limit)
    elif stage == Stage.STAGE_RUN:
        text = f"The kernel failed at run time: {_trim(verdict.runtime_error or verdict.message, limit)}"
    elif stage == Stage.STAGE_CORRECT:
        m = verdict.mismatch
        if m.reason in ("", "values", "nan"):
            text = (
                f"Wrong output {m.output}: {m.bad_elements} of {m.total_elements} values wrong; "
                f"at index {m.first_bad_index} expected {m.expected:.6g}, got {m.got:.6g} "
                f"(max abs error {m.max_abs_error:.3g})."
            )
        else:
            text = f"Wrong output {m.output}: {m.reason}."
    elif stage == Stage.STAGE_PASSED:
        if verdict.speedup > 0:
            return f"Correct. Speedup {verdict.speedup:.2f}x over the reference. Make it faster."
        return "Correct. Make it faster."
    else:
        text = verdict.message or "The evaluation failed."
    return _trim(text, limit) + " Fix the code."


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+\-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The code of the last fenced block in a model response, or None when it has none.

    An opening fence without a closing one (a completion cut at max tokens) yields the rest
    of the text: it will most likely fail to compile, which is the honest verdict.
    """
    blocks = [match.group(2) for match in _FENCE.finditer(response)]
    blocks = [block for block in blocks if block.strip()]
    return blocks[-1].strip("\n") + "\n" if blocks else None


def render(messages: Sequence[ChatMessage]) -> str:
    """A readable transcript, for logs and reports."""
    return "\n\n".join(f"[{m.role}]\n{m.content}" for m in messages)


def as_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The form Hugging Face chat templates take."""
    return [{"role": m.role, "content": m.content} for m in messages]


def continuation_text(tokenizer, history: Sequence[ChatMessage], message: ChatMessage) -> str:
    """The text a chat template adds for one more user `message` after `history` (which ends
    with an assistant turn), including the header that asks the model to answer.

    Multi-turn rollouts keep the sampled tokens of earlier turns exactly and append only the
    tokens of this text, so the learner scores the very tokens the sampler produced.
    """
    before = tokenizer.apply_chat_template(as_dicts(history), tokenize=False, add_generation_prompt=False)
    after = tokenizer.apply_chat_template(as_dicts([*history, message]), tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render a dialogue as a prefix of its continuation")
    return after[len(before):]


ANSWER_PLACEHOLDER = "LEAP-ANSWER-PLACEHOLDER"  # no spaces or newlines: templates that trim keep it whole


def answer_closing(tokenizer, history: Sequence[ChatMessage]) -> str:
    """What the chat template renders after the content of an assistant answer that follows
    `history` (for example "<|end|>", or "<|im_end|>\n")."""
    rendered = tokenizer.apply_chat_template(as_dicts([*history, assistant(ANSWER_PLACEHOLDER)]), tokenize=False,
                                             add_generation_prompt=False)
    return rendered[rendered.rindex(ANSWER_PLACEHOLDER) + len(ANSWER_PLACEHOLDER):]


def continuation_ids(tokenizer, history: Sequence[ChatMessage], message: ChatMessage, *, end_text: str | None) -> list[int]:
    """Token ids to append after the sampled tokens of the last assistant turn of `history`
    so the result is the whole dialogue with `message` added, ready for the next answer.

    `end_text` is the text of the token that ended the sampled answer (its end-of-turn
    token), or None when the answer was cut at max tokens. The template's closing of an
    answer may render more after that token (a newline, say), which the sampler never
    produced; a cut answer lacks the end-of-turn token itself. Both are supplied here as text,
    so a multi-turn rollout keeps every sampled token and the learner scores the very tokens
    the sampler saw.
    """
    closing = answer_closing(tokenizer, history[:-1])
    if end_text is not None:
        # ended by the template's own end-of-turn token: what follows it; by another stop
        # token the template does not render: nothing (trust the sampler's stop)
        closing = closing[len(end_text):] if closing.startswith(end_text) else ""
    text = closing + continuation_text(tokenizer, history, message)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
