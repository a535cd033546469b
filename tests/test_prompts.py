"""The shared prompt and feedback format."""

from __future__ import annotations

import pytest

from leap import prompts
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2

Stage = common_pb2.Stage
CPU = common_pb2.Toolchain.TOOLCHAIN_CPU


def relu_task() -> sandbox_pb2.Task:
    return sandbox_pb2.Task(
        id="relu", title="ReLU", statement="y[i] = max(x[i], 0) for i < n.",
        entry_point=sandbox_pb2.EntryPoint(name="relu", c_declaration='extern "C" void relu(const float* x, float* y, int64_t n);'),
    )


def test_task_prompt_names_the_task_the_declaration_and_the_fence():
    text = prompts.task_prompt(relu_task(), CPU)
    assert "relu" in text and "max(x[i], 0)" in text
    assert 'extern "C" void relu(const float* x, float* y, int64_t n);' in text
    assert "```cpp" in text


@pytest.mark.parametrize(
    "response, code",
    [
        ("Here:\n```cpp\nint f();\n```\n", "int f();\n"),
        ("```c++\nA\n```\ntext\n```cpp\nB\n```", "B\n"),  # the last block wins
        ("```cpp\nint cut_off(", "int cut_off(\n"),  # no closing fence: the rest
        ("no code at all", None),
        ("```cpp\n\n```", None),
    ],
)
def test_extract_code(response, code):
    assert prompts.extract_code(response) == code


def test_answer_round_trips_through_extract_code():
    assert prompts.extract_code(prompts.answer("int x = 1;", CPU)) == "int x = 1;\n"


def test_feedback_reports_each_stage():
    compile_fail = sandbox_pb2.Verdict(stage=Stage.STAGE_COMPILE, compile=sandbox_pb2.CompileInfo(
        log="k.cpp: In function 'void relu':\nk.cpp:3:5: error: 'yy' was not declared in this scope\n   3 | yy[i] = 0;"))
    assert "error: 'yy' was not declared" in prompts.feedback(compile_fail)
    wrong = sandbox_pb2.Verdict(stage=Stage.STAGE_CORRECT, mismatch=sandbox_pb2.Mismatch(
        output="y", first_bad_index=7, expected=1.5, got=-1.5, max_abs_error=3.0, bad_elements=4, total_elements=64, reason="values"))
    text = prompts.feedback(wrong)
    assert "index 7" in text and "expected 1.5" in text and "got -1.5" in text and "4 of 64" in text
    crash = sandbox_pb2.Verdict(stage=Stage.STAGE_RUN, runtime_error="killed by signal SIGSEGV")
    assert "SIGSEGV" in prompts.feedback(crash)
    fast = sandbox_pb2.Verdict(stage=Stage.STAGE_PASSED, speedup=1.734)
    assert "1.73x" in prompts.feedback(fast)


def test_feedback_is_trimmed():
    verdict = sandbox_pb2.Verdict(stage=Stage.STAGE_RUN, runtime_error="x" * 5000)
    assert len(prompts.feedback(verdict)) < prompts.FEEDBACK_MAX_CHARS + 40


def test_continuation_text_is_the_template_suffix():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = prompts.SIMPLE_CHAT_TEMPLATE
    history = [prompts.user("write relu"), prompts.assistant("```cpp\nA\n```")]
    extra = prompts.continuation_text(tokenizer, history, prompts.user("Compilation failed"))
    assert extra == "<|user|>\nCompilation failed<|end|><|assistant|>\n"
    whole = tokenizer.apply_chat_template(prompts.as_dicts([*history, prompts.user("Compilation failed")]),
                                          tokenize=False, add_generation_prompt=True)
    assert whole.endswith(extra)


NEWLINE_AFTER_END_TEMPLATE = prompts.SIMPLE_CHAT_TEMPLATE.replace("<|end|>", "<|end|>\n")  # as Qwen's template does
TRIMMING_TEMPLATE = prompts.SIMPLE_CHAT_TEMPLATE.replace("message['content'] }}", "message['content'] | trim }}")  # Llama 3


@pytest.mark.parametrize("template", [prompts.SIMPLE_CHAT_TEMPLATE, NEWLINE_AFTER_END_TEMPLATE, TRIMMING_TEMPLATE])
@pytest.mark.parametrize("closed", [True, False])
def test_continuation_ids_rebuild_the_whole_dialogue_after_the_sampled_tokens(tmp_path, template, closed):
    """Sampled tokens (ending with the end-of-turn token, or cut before it) plus the
    continuation are token for token the template's rendering of the longer dialogue."""
    from tests.tiny_lm import build_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    tokenizer.chat_template = template
    task = prompts.first_turn(relu_task(), CPU)
    answer = prompts.answer("extern \"C\" void relu() {}", CPU)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt_ids = encode(tokenizer.apply_chat_template(prompts.as_dicts(task), tokenize=False, add_generation_prompt=True))
    sampled = encode(answer) + ([tokenizer.eos_token_id] if closed else [])
    history = [*task, prompts.assistant(answer)]
    feedback = prompts.user("Compilation failed: error. Fix the code.")
    end_text = tokenizer.eos_token if closed else None
    ids = prompt_ids + sampled + prompts.continuation_ids(tokenizer, history, feedback, end_text=end_text)
    whole = tokenizer.apply_chat_template(prompts.as_dicts([*history, feedback]), tokenize=False, add_generation_prompt=True)
    assert ids == encode(whole)


def test_continuation_ids_of_an_answer_the_template_trims(tmp_path):
    """A template that trims answers (Llama 3's) renders a sampled trailing newline away; the
    continuation is still found (the answer's closing comes from a placeholder answer)."""
    from tests.tiny_lm import build_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    tokenizer.chat_template = TRIMMING_TEMPLATE
    history = [*prompts.first_turn(relu_task(), CPU), prompts.assistant("```cpp\nint x;\n```\n\n")]
    ids = prompts.continuation_ids(tokenizer, history, prompts.user("Fix the code."), end_text=None)
    assert tokenizer.decode(ids) == "<|end|><|user|>\nFix the code.<|end|><|assistant|>\n"
