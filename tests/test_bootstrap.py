"""The tiny model bootstrap (leap.bootstrap, `leap bootstrap-model`): the dialogues are the
trainer's, the tokenizer carries LEAP's special tokens and chat template, a build is
deterministic and cached, and the bootstrapped model, served by the hf backend, answers
first turns with code of which some compiles and some does not (checked with g++)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from leap import bootstrap, prompts
from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import BackgroundServer
from leap.sandbox.v1 import sandbox_pb2
from svc_policy.server import PolicyConfig, build
from tests.conftest import BOOTSTRAP_CACHE, ROOT, free_port, subprocess_env, task_suite
from tests.tiny_suite import tiny_suite

Kind = sandbox_pb2.ExampleKind
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")


def test_dialogues_are_the_trainers_format():
    tasks = tiny_suite()
    dialogues = bootstrap.build_dialogues(tasks, dataclasses.replace(bootstrap.BootstrapConfig(), three_turn=True))
    train = [t for t in tasks if t.split == "train"]
    assert {d.messages[0].content for d in dialogues} == {prompts.task_prompt(t) for t in train}
    task = train[0]
    sources = {e.kind: e.source for e in task.examples}
    mine = [d for d in dialogues if d.messages[0].content == prompts.task_prompt(task)]
    first_turns = [d.messages[1].content for d in mine]
    # Passing examples twice as often as each broken one, all as the trainer's answers.
    assert first_turns.count(prompts.answer(sources[Kind.EXAMPLE_KIND_SOLUTION])) == 2
    for kind in (Kind.EXAMPLE_KIND_SYNTAX_ERROR, Kind.EXAMPLE_KIND_WRONG_OUTPUT, Kind.EXAMPLE_KIND_CRASH):
        assert prompts.answer(sources[kind]) in first_turns
    debugging = [d for d in mine if len(d.messages) >= 4]
    assert debugging and all(d.messages[-1].content == prompts.answer(sources[Kind.EXAMPLE_KIND_SOLUTION])
                             for d in debugging)
    assert any(len(d.messages) == 6 for d in debugging)  # a three-turn dialogue
    feedback = {d.messages[1].content: d.messages[2].content for d in debugging if len(d.messages) == 4}
    syntax = feedback[prompts.answer(sources[Kind.EXAMPLE_KIND_SYNTAX_ERROR])]
    assert syntax.startswith("Compilation failed:")
    if shutil.which("g++"):
        assert "kernel.cpp:" in syntax and "error:" in syntax  # the real compiler log
    assert feedback[prompts.answer(sources[Kind.EXAMPLE_KIND_CRASH])].startswith("The kernel failed at run time")
    assert feedback[prompts.answer(sources[Kind.EXAMPLE_KIND_WRONG_OUTPUT])].startswith("Wrong output y:")


def test_tokenizer_and_loss_mask():
    config = bootstrap.MICRO_CONFIG
    dialogues = bootstrap.build_dialogues(tiny_suite(), config)
    tokenizer = bootstrap.train_tokenizer(sorted({"\n" + m.content for d in dialogues for m in d.messages}), config)
    for special in prompts.SPECIAL_TOKENS:
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer.eos_token == prompts.END_OF_TURN and tokenizer.chat_template == prompts.SIMPLE_CHAT_TEMPLATE
    text = "naïve ✓ 0x1F\tΩ"  # byte-level: any text round-trips, even unseen characters
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    dialogue = next(d for d in dialogues if len(d.messages) == 4)
    ids, trained = bootstrap.encode_dialogue(tokenizer, dialogue)
    # The trained tokens are exactly the two assistant answers and their end-of-turn tokens.
    spans, current = [], []
    for token, loss in zip(ids, trained):
        if loss:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    assert [tokenizer.decode(s) for s in spans] == [dialogue.messages[1].content + prompts.END_OF_TURN,
                                                    dialogue.messages[3].content + prompts.END_OF_TURN]


def test_bootstrap_is_deterministic_and_cached(tmp_path, monkeypatch):
    tasks, config = tiny_suite(), bootstrap.MICRO_CONFIG
    first = bootstrap.bootstrap_model(tasks=tasks, config=config, cache_dir=tmp_path / "a", progress=False)
    second = bootstrap.bootstrap_model(tasks=tasks, config=config, cache_dir=tmp_path / "b", progress=False)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = bootstrap.bootstrap_model(tasks=tasks, config=dataclasses.replace(config, seed=1),
                                      cache_dir=tmp_path / "a", progress=False)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached model was built again")

    monkeypatch.setattr(bootstrap, "build", no_rebuild)
    assert bootstrap.bootstrap_model(tasks=tasks, config=config, cache_dir=tmp_path / "a", progress=False) == first
    copy = bootstrap.bootstrap_model(tmp_path / "out", tasks=tasks, config=config, cache_dir=tmp_path / "a",
                                     progress=False)
    assert (copy / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    # A changed suite is a new key: it is built.
    changed = tiny_suite()
    changed[0].statement += " Mind the sign."
    with pytest.raises(AssertionError, match="built again"):
        bootstrap.bootstrap_model(tasks=changed, config=config, cache_dir=tmp_path / "a", progress=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        bootstrap.bootstrap_model(tmp_path / "taken", tasks=tasks, config=config, cache_dir=tmp_path / "a",
                                  progress=False)


def compiles(code: str) -> bool:
    with tempfile.TemporaryDirectory() as work:
        Path(work, "kernel.cpp").write_text(code)
        return subprocess.run(["g++", "-fsyntax-only", "-fopenmp", "-std=c++17", "kernel.cpp"], cwd=work,
                              capture_output=True, timeout=60).returncode == 0


@pytest.mark.slow  # the first user of tiny_model_dir: a fresh checkout pays the bootstrap (about 2 minutes) here
@needs_gxx
def test_the_bootstrapped_model_answers_with_code_some_compiling_some_not(tiny_model_dir):
    manifest = (tiny_model_dir / bootstrap.MANIFEST).read_text()
    assert '"parameters"' in manifest
    config = PolicyConfig(port=free_port(), drain_seconds=0.0, models=[f"policy={tiny_model_dir}"])
    tasks = [t for t in task_suite() if t.split == "train"]
    request = policy_pb2.GenerateRequest(model="policy", sampling=policy_pb2.SamplingParams(
        n=4, seed=0, temperature=1.0, max_new_tokens=512), prompts=[
        policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(t))) for t in tasks])
    with BackgroundServer(build(config), config) as server, grpc.insecure_channel(server.address) as channel:
        response = policy_pb2_grpc.PolicyServiceStub(channel).Generate(request, timeout=600)
    codes = [prompts.extract_code(c.text) for c in response.completions]
    assert sum(code is not None for code in codes) >= len(codes) // 2, "most answers should hold a code block"
    results = [compiles(code) for code in codes if code is not None]
    assert any(results) and not all(results), f"{sum(results)} of {len(results)} answers compile"


def test_the_command_copies_the_cached_model_and_reports(tiny_model_dir, tmp_path):
    """`leap bootstrap-model DIR` with the default settings finds the fixture's build in the
    cache (same suite, same settings) and copies it; a typo is one friendly line."""
    out = tmp_path / "tiny"
    command = [sys.executable, "-m", "leap", "bootstrap-model", str(out), "--quiet", "--cache-dir", str(BOOTSTRAP_CACHE)]
    run = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "parameters" in run.stdout and "from the cache" in run.stdout
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    wrong = subprocess.run([sys.executable, "-m", "leap", "bootstrap-model", str(out), "--toolchains", "fortran"],
                           cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "--toolchains" in wrong.stderr
