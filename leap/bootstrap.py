"""The tiny model of the embedded default, built from the task suite alone (nothing is
downloaded): a byte-level BPE tokenizer trained on the suite's dialogues, a small
Qwen2-style causal LM, and a supervised warm start on those dialogues, so that first-turn
sampling at temperature 1 gives a mix of passing and failing answers and debugging turns
have something to build on.

    from leap.bootstrap import bootstrap_model
    model_dir = bootstrap_model("runs/tiny-model")            # the built-in suite, cached

The dialogues are exactly the trainer's (leap.prompts): `first_turn(task)` answered by
`answer(code)`, and for broken variants `feedback(verdict)` then a fixed answer. The
verdicts of broken variants are synthetic, except that syntax errors of C++ examples carry
the real log of `g++ -fsyntax-only` where g++ is installed.

Results are cached under a key of (suite, config, this code, library versions): a second
call with the same inputs copies the cached directory, or returns it, at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from leap import prompts
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2

Kind = sandbox_pb2.ExampleKind
Stage = common_pb2.Stage
Toolchain = common_pb2.Toolchain

PAD_TOKEN = "<|pad|>"
MANIFEST = "bootstrap.json"
TOOLCHAIN_NAMES = {"cpu": Toolchain.TOOLCHAIN_CPU, "cuda": Toolchain.TOOLCHAIN_CUDA,
                   "kernelbench": Toolchain.TOOLCHAIN_KERNELBENCH}
PASSING = (Kind.EXAMPLE_KIND_SOLUTION, Kind.EXAMPLE_KIND_SLOW)
BROKEN = (Kind.EXAMPLE_KIND_SYNTAX_ERROR, Kind.EXAMPLE_KIND_WRONG_OUTPUT, Kind.EXAMPLE_KIND_CRASH)
SOURCE_SUFFIX = {Toolchain.TOOLCHAIN_CPU: "cpp", Toolchain.TOOLCHAIN_CUDA: "cu", Toolchain.TOOLCHAIN_KERNELBENCH: "py"}


@dataclasses.dataclass(frozen=True)
class BootstrapConfig:
    """Everything that decides the bootstrapped model (all of it enters the cache key)."""

    seed: int = 0
    splits: tuple[str, ...] = ("train",)  # task splits whose examples are trained on
    toolchains: tuple[str, ...] = ("cpu",)  # example toolchains trained on
    vocab_size: int = 2048
    min_pair_count: int = 1  # BPE merges pairs seen this often (1: long tokens, short sequences)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_context_tokens: int = 2048
    solution_copies: int = 2  # first-turn copies of each solution (slow and broken variants: 1)
    debug_turns: bool = True  # add broken -> feedback -> fixed dialogues
    three_turn: bool = False  # and one broken -> feedback -> broken -> feedback -> fixed per task
    epochs: float = 50.0  # passes over the training tokens (the warm start memorizes the examples) ...
    max_steps: int = 1000  # ... but at most this many optimizer steps
    batch_tokens: int = 2048  # padded tokens per optimizer step
    bf16: bool = True  # bfloat16 autocast for matmuls where the CPU has native bf16 (fp32 elsewhere)
    learning_rate: float = 5e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# For tests of the bootstrap itself (determinism, caching, the command): seconds, not minutes.
MICRO_CONFIG = BootstrapConfig(vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                               intermediate_size=64, max_context_tokens=1024, epochs=1.0, max_steps=4)


@dataclasses.dataclass
class Dialogue:
    """One training dialogue; the assistant messages at `train` carry the loss."""

    messages: list[common_pb2.ChatMessage]
    train: tuple[int, ...]


# -- the dialogues -------------------------------------------------------------------------


def _synthetic_verdict(task: sandbox_pb2.Task, example: sandbox_pb2.Example, rng: random.Random,
                       compile_log: str | None) -> sandbox_pb2.Verdict:
    kind = example.kind
    if kind == Kind.EXAMPLE_KIND_SYNTAX_ERROR:
        log = compile_log or f"kernel.{SOURCE_SUFFIX.get(example.toolchain, 'cpp')}: error: expected ';' before '}}' token"
        return sandbox_pb2.Verdict(stage=Stage.STAGE_COMPILE, compile=sandbox_pb2.CompileInfo(log=log))
    if kind == Kind.EXAMPLE_KIND_CRASH:
        return sandbox_pb2.Verdict(stage=Stage.STAGE_RUN, runtime_error="killed by signal SIGSEGV (invalid memory access)")
    outputs = [a.name for a in task.entry_point.arguments if a.role == sandbox_pb2.ArgumentRole.ARGUMENT_ROLE_OUTPUT]
    total = rng.choice([256, 1024, 4096])
    expected = round(rng.uniform(-2, 2), 4)
    got = round(expected + rng.choice([-1, 1]) * rng.uniform(0.5, 2), 4)
    return sandbox_pb2.Verdict(stage=Stage.STAGE_CORRECT, mismatch=sandbox_pb2.Mismatch(
        output=outputs[0] if outputs else "out", first_bad_index=rng.randrange(0, 16), expected=expected, got=got,
        max_abs_error=abs(got - expected), bad_elements=rng.randrange(total // 4, total), total_elements=total,
        reason="values"))


def gxx_syntax_log(source: str) -> str | None:
    """The diagnostics of `g++ -fsyntax-only` for a C++ source, or None without g++."""
    compiler = shutil.which("g++")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as work:
        Path(work, "kernel.cpp").write_text(source)
        run = subprocess.run([compiler, "-fsyntax-only", "-fopenmp", "-std=c++17", "kernel.cpp"], cwd=work,
                             capture_output=True, text=True, timeout=60)
    return run.stderr.strip() or None


def _compile_logs(examples: Sequence[sandbox_pb2.Example]) -> dict[str, str | None]:
    from concurrent.futures import ThreadPoolExecutor

    sources = sorted({e.source for e in examples
                      if e.kind == Kind.EXAMPLE_KIND_SYNTAX_ERROR and e.toolchain == Toolchain.TOOLCHAIN_CPU})
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(sources, pool.map(gxx_syntax_log, sources)))


def build_dialogues(tasks: Sequence[sandbox_pb2.Task], config: BootstrapConfig) -> list[Dialogue]:
    """The warm start's training dialogues, in a fixed order."""
    toolchains = {TOOLCHAIN_NAMES[name] for name in config.toolchains}
    chosen = [t for t in sorted(tasks, key=lambda t: t.id) if t.split in config.splits]
    logs = _compile_logs([e for t in chosen for e in t.examples])
    dialogues: list[Dialogue] = []
    for task in chosen:
        rng = random.Random(f"{config.seed}:{task.id}")
        for toolchain in sorted(toolchains):
            examples = [e for e in task.examples if e.toolchain == toolchain]
            passing = [e for e in examples if e.kind in PASSING]
            broken = [e for e in examples if e.kind in BROKEN]
            if not passing:
                continue
            opening = prompts.first_turn(task, toolchain)
            for example in passing:
                copies = config.solution_copies if example.kind == Kind.EXAMPLE_KIND_SOLUTION else 1
                for _ in range(copies):
                    dialogues.append(Dialogue([*opening, prompts.assistant(prompts.answer(example.source, toolchain))], (1,)))
            fixed = prompts.assistant(prompts.answer(passing[0].source, toolchain))
            turns = []
            for example in broken:
                attempt = prompts.assistant(prompts.answer(example.source, toolchain))
                if not config.debug_turns:
                    dialogues.append(Dialogue([*opening, attempt], (1,)))
                    continue
                # The broken first answer is trained too: it is the first-turn example of this
                # variant, and its feedback is answered by the fix.
                verdict = _synthetic_verdict(task, example, rng, logs.get(example.source))
                turns.append([attempt, prompts.user(prompts.feedback(verdict))])
                dialogues.append(Dialogue([*opening, *turns[-1], fixed], (1, 3)))
            if config.three_turn and len(turns) >= 2:
                first, second = rng.sample(turns, 2)
                dialogues.append(Dialogue([*opening, *first, *second, fixed], (1, 5)))
    return dialogues


def dialogue_text(tokenizer, messages: Sequence[common_pb2.ChatMessage], generation: bool = False) -> str:
    return tokenizer.apply_chat_template(prompts.as_dicts(messages), tokenize=False, add_generation_prompt=generation)


def encode_dialogue(tokenizer, dialogue: Dialogue) -> tuple[list[int], list[bool]]:
    """Token ids of the whole rendered dialogue and, per id, whether it carries loss: the
    content of each trained assistant message and its end-of-turn token."""
    ids: list[int] = []
    trained: list[bool] = []
    done = 0
    for index in range(len(dialogue.messages)):
        if dialogue.messages[index].role != "assistant":
            continue
        head = dialogue_text(tokenizer, dialogue.messages[:index], generation=True)
        whole = dialogue_text(tokenizer, dialogue.messages[: index + 1])
        for text, loss in ((head[done:], False), (whole[len(head):], index in dialogue.train)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            trained += [loss] * len(piece)
        done = len(whole)
    full = tokenizer(dialogue_text(tokenizer, dialogue.messages), add_special_tokens=False)["input_ids"]
    if full != ids:
        raise ValueError("the tokenizer does not split the dialogue at message boundaries")
    return ids, trained


# -- the tokenizer and the model ---------------------------------------------------------


def train_tokenizer(texts: Sequence[str], config: BootstrapConfig):
    """A byte-level BPE tokenizer with LEAP's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.vocab_size, min_frequency=config.min_pair_count, show_progress=False,
                                  special_tokens=[PAD_TOKEN, *prompts.SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=prompts.END_OF_TURN, pad_token=PAD_TOKEN,
                                        model_max_length=config.max_context_tokens, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = prompts.SIMPLE_CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, config: BootstrapConfig):
    """A freshly initialized Qwen2ForCausalLM sized by `config` (seeded)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(config.seed)
    end = tokenizer.convert_tokens_to_ids(prompts.END_OF_TURN)
    model_config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_context_tokens,
        tie_word_embeddings=True, use_sliding_window=False, bos_token_id=None, eos_token_id=end,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(model_config)
    model.generation_config = GenerationConfig(eos_token_id=end, pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=None, do_sample=True, temperature=1.0)
    return model


# -- supervised warm start ---------------------------------------------------------------


def _batches(examples: list[tuple[list[int], list[bool]]], config: BootstrapConfig) -> Iterator[list[int]]:
    """Forever: indices of examples of similar length whose padded size fits batch_tokens,
    drawn without replacement per epoch (seeded)."""
    rng = random.Random(config.seed)
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        # Sort within windows of 64 so batches pad little but epochs still mix.
        for start in range(0, len(order), 64):
            window = sorted(order[start : start + 64], key=lambda i: len(examples[i][0]))
            batch: list[int] = []
            for index in window:
                width = max(len(examples[i][0]) for i in [*batch, index])
                if batch and width * (len(batch) + 1) > config.batch_tokens:
                    yield batch
                    batch = []
                batch.append(index)
            if batch:
                yield batch


def training_steps(examples: list[tuple[list[int], list[bool]]], config: BootstrapConfig) -> int:
    tokens = sum(len(ids) for ids, _ in examples)
    return max(1, min(config.max_steps, math.ceil(config.epochs * tokens / config.batch_tokens)))


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (else autocast would emulate it, slowly)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def fine_tune(model, examples: list[tuple[list[int], list[bool]]], pad_id: int, config: BootstrapConfig,
              progress: bool = True) -> list[float]:
    """Token-mean cross-entropy on the trained tokens, AdamW with warm-up and cosine decay
    (to a tenth). Returns the loss of every step."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    model.train()
    steps = training_steps(examples, config)
    autocast = config.bf16 and native_bf16()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.98),
                                  weight_decay=config.weight_decay)
    warmup = min(config.warmup_steps, max(1, steps // 10))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    batches = _batches(examples, config)
    losses: list[float] = []
    bar = tqdm(range(steps), desc="warm start", unit="step", disable=not progress, leave=False)
    for _ in bar:
        batch = next(batches)
        width = max(len(examples[i][0]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):
            tokens, trained = examples[index]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
            labels[row, : len(tokens)] = torch.where(torch.tensor(trained), torch.tensor(tokens), -100)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


# -- caching and the entry point ---------------------------------------------------------


def cache_key(tasks: Sequence[sandbox_pb2.Task], config: BootstrapConfig) -> str:
    """Hash of what decides the result: the suite, the config, this code and the libraries."""
    import tokenizers
    import torch
    import transformers

    digest = hashlib.sha256()
    for task in sorted(tasks, key=lambda t: t.id):
        digest.update(hashlib.sha256(task.SerializeToString(deterministic=True)).digest())
    digest.update(json.dumps(config.to_json(), sort_keys=True).encode())
    for module in (__file__, prompts.__file__):
        digest.update(Path(module).read_bytes())
    digest.update(f"{torch.__version__} {transformers.__version__} {tokenizers.__version__}".encode())
    digest.update(f"bf16={config.bf16 and native_bf16()}".encode())
    return digest.hexdigest()[:20]


def default_cache_dir() -> Path:
    """$LEAP_CACHE_DIR/bootstrap, else ~/.cache/leap/bootstrap."""
    root = os.environ.get("LEAP_CACHE_DIR") or Path.home() / ".cache" / "leap"
    return Path(root) / "bootstrap"


def load_builtin_suite() -> list[sandbox_pb2.Task]:
    from leap.tasks import load_suite  # the built-in suite (shared data)

    return list(load_suite())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_bootstrapped(directory: Path, key: str) -> bool:
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("key") == key
    except (OSError, ValueError):
        return False


def build(tasks: Sequence[sandbox_pb2.Task], config: BootstrapConfig, out_dir: Path, progress: bool = True) -> dict:
    """Build the model into `out_dir` (no caching); return its manifest."""
    import torch

    started = time.perf_counter()
    dialogues = build_dialogues(tasks, config)
    if not dialogues:
        raise ValueError(f"no task of split {'/'.join(config.splits)} has a passing "
                         f"{'/'.join(config.toolchains)} example to train on")
    # The tokenizer learns from every distinct message once, as the template frames it (the
    # special tokens themselves are added whole, never merged).
    texts = sorted({"\n" + m.content for d in dialogues for m in d.messages})
    tokenizer = train_tokenizer(texts, config)
    examples = [encode_dialogue(tokenizer, d) for d in dialogues]
    too_long = max(len(ids) for ids, _ in examples)
    if too_long > config.max_context_tokens:
        raise ValueError(f"a training dialogue has {too_long} tokens, more than max_context_tokens "
                         f"{config.max_context_tokens}")
    model = build_model(tokenizer, config)
    threads = torch.get_num_threads()
    losses = fine_tune(model, examples, tokenizer.pad_token_id, config, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # ours is the one that counts
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    manifest = {
        "config": config.to_json(),
        "tasks": sorted({t.id for t in tasks if t.split in config.splits}),
        "dialogues": len(dialogues),
        "training_tokens": sum(len(ids) for ids, _ in examples),
        "steps": len(losses),
        "bf16_autocast": config.bf16 and native_bf16(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": round(time.perf_counter() - started, 1),
        "torch_threads": threads,
    }
    return manifest


def bootstrap_model(out_dir: str | os.PathLike | None = None, tasks: Sequence[sandbox_pb2.Task] | None = None,
                    config: BootstrapConfig | None = None, cache_dir: str | os.PathLike | None = None,
                    progress: bool = True) -> Path:
    """The bootstrapped model directory for `tasks` (default: the built-in suite).

    Built once per cache key into `cache_dir` (default `default_cache_dir()`); with
    `out_dir`, the result is also copied there (instantly when it already holds it) and
    that path is returned, else the cached directory itself (treat it as read-only).
    """
    config = config or BootstrapConfig()
    tasks = list(tasks) if tasks is not None else load_builtin_suite()
    key = cache_key(tasks, config)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache / key
    target = Path(out_dir) if out_dir is not None else None
    if target is not None and is_bootstrapped(target, key):
        return target
    with _locked(cache / f"{key}.lock"):
        if not is_bootstrapped(cached, key):
            staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cache))
            try:
                manifest = build(tasks, config, staging, progress)
                manifest["key"] = key
                (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
                if cached.exists():
                    shutil.rmtree(cached)
                staging.rename(cached)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    if target is None:
        return cached
    if target.exists() and any(target.iterdir()):
        if not (target / MANIFEST).is_file():
            raise FileExistsError(f"{target} exists and is not a bootstrapped model directory; choose an empty one")
        shutil.rmtree(target)
    shutil.copytree(cached, target, dirs_exist_ok=True)
    return target
