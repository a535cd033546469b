"""Tokenizer-side work shared by both backends: prompts to token ids, stop strings, the text
of a completion, the end-of-sequence ids of a model directory."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from leap.policy.v1 import policy_pb2


def render_prompt(tokenizer, prompt: policy_pb2.Prompt) -> list[int]:
    """The token ids the model sees for `prompt`.

    text: the tokenizer's own encoding (with the special tokens it adds, such as a BOS);
    chat: the chat template rendered to text, then encoded without adding special tokens
    (the template writes them itself); token_ids: as given.
    """
    kind = prompt.WhichOneof("kind")
    if kind == "token_ids":
        return list(prompt.token_ids.ids)
    if kind == "text":
        return list(tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
    messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
    generation = prompt.chat.add_generation_prompt if prompt.chat.HasField("add_generation_prompt") else True
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if generation else "")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_token_ids(tokenizer, *configs) -> list[int]:
    """Every end-of-sequence id named by the tokenizer, the model config or the generation
    config (each may hold one id or a list)."""
    ids: set[int] = set()
    for source in (*configs, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
            ids.update(int(v) for v in value if v is not None)
    return sorted(ids)


class StopStrings:
    """Detects a stop string at the end of a growing completion, decoding only a window of
    recent tokens each step (a stop string found there is new: it would have been found at
    an earlier step otherwise)."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        # A byte-level token can be a fraction of a character: 4 bytes per character at most.
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 4

    def hit(self, token_ids: Sequence[int]) -> bool:
        if not self.stops:
            return False
        tail = self.tokenizer.decode(token_ids[-self.window:], skip_special_tokens=False)
        return any(stop in tail for stop in self.stops)


def completion_text(tokenizer, token_ids: Sequence[int], stops: Sequence[str], end_ids: Iterable[int]) -> str:
    """The text of a completion: its tokens decoded (a final end-of-sequence or stop token
    left out) and cut right after the first stop string, which is kept."""
    ids = list(token_ids)
    if ids and ids[-1] in set(end_ids):
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    cuts = [text.find(s) + len(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text
