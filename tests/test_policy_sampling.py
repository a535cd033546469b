"""The policy's pure pieces: the sampling distribution, counter-based uniforms, inverse-CDF
draws, the batch KV cache, stop strings and the tokenizer fingerprint."""

from __future__ import annotations

import math

import pytest
import torch

from svc_policy import sampling


def brute_force_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The documented distribution, one token at a time in plain Python."""
    q = [math.exp(z / temperature) for z in logits]
    total = sum(q)
    q = [x / total for x in q]
    order = sorted(range(len(q)), key=lambda i: -q[i])
    kept = order if top_k == 0 else [i for i in order if q[i] >= q[order[top_k - 1]]]
    mass = sum(q[i] for i in kept)
    nucleus, before = [], 0.0
    for i in kept:
        if nucleus and before >= top_p:
            break
        nucleus.append(i)
        before += q[i] / mass
    z = sum(q[i] for i in nucleus)
    return [q[i] / z if i in nucleus else 0.0 for i in range(len(q))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6),
                                                       (0.8, 4, 0.7), (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_sampling_logprobs_match_the_documented_distribution(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 9, generator=generator) * 2
    lp = sampling.sampling_logprobs(logits, torch.tensor([temperature] * 2), torch.tensor([top_k] * 2),
                                    torch.tensor([top_p] * 2))
    for row in range(2):
        expected = brute_force_distribution(logits[row].tolist(), temperature, top_k, top_p)
        got = lp[row].exp().tolist()
        assert got == pytest.approx(expected, abs=1e-6)


def test_rows_of_one_batch_use_their_own_parameters():
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))
    temperature, top_k, top_p = torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.5])
    together = sampling.sampling_logprobs(logits, temperature, top_k, top_p)
    for row in range(3):
        alone = sampling.sampling_logprobs(logits[row : row + 1], temperature[row : row + 1], top_k[row : row + 1],
                                           top_p[row : row + 1])
        assert torch.equal(together[row], alone[0])


def test_uniform_streams_are_deterministic_distinct_and_uniform():
    key = sampling.stream_key(7, 0, 0)
    assert key == sampling.stream_key(7, 0, 0)
    keys = {sampling.stream_key(7, i, j) for i in range(20) for j in range(20)} | {sampling.stream_key(8, 0, 0)}
    assert len(keys) == 401
    values = [sampling.uniform(key, t) for t in range(20000)]
    assert all(0.0 <= u < 1.0 for u in values)
    assert sum(values) / len(values) == pytest.approx(0.5, abs=0.01)
    assert sum(u < 0.1 for u in values) / len(values) == pytest.approx(0.1, abs=0.01)


def test_draw_follows_the_distribution_and_never_picks_a_removed_token():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    lp = sampling.sampling_logprobs(logits, torch.tensor([1.0]), torch.tensor([3]), torch.tensor([1.0]))
    key = sampling.stream_key(0, 0, 0)
    draws = 20000
    uniforms = torch.tensor([sampling.uniform(key, t) for t in range(draws)], dtype=torch.float64)
    tokens = sampling.draw(lp.expand(draws, -1), uniforms, torch.zeros(draws, dtype=torch.bool))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[2] == 0 and counts[3] == 0  # outside the top 3
    assert (counts / draws).tolist() == pytest.approx(lp[0].exp().tolist(), abs=0.015)
    # The extreme uniforms land on the first and the last kept token.
    assert sampling.draw(lp, torch.tensor([0.0], dtype=torch.float64), torch.tensor([False])).item() == 0
    assert sampling.draw(lp, torch.tensor([1.0 - 2**-53], dtype=torch.float64), torch.tensor([False])).item() == 4


def test_greedy_takes_the_argmax_and_reports_the_untempered_logprob():
    logits = torch.tensor([[0.5, 2.5, 2.0]])
    lp = sampling.sampling_logprobs(logits, torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]))
    token = sampling.draw(lp, torch.tensor([0.99], dtype=torch.float64), torch.tensor([True]))
    assert token.item() == 1
    assert lp[0, 1].item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_score_logprobs_with_truncation_equals_sampling_logprobs():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(5))
    targets = torch.tensor([0, 3, 5, 9])
    plain = sampling.score_logprobs(logits, targets, 0.9)
    assert plain.tolist() == pytest.approx(torch.log_softmax(logits / 0.9, -1).gather(-1, targets[:, None])[:, 0].tolist())
    truncated = sampling.score_logprobs(logits, targets, 0.9, top_k=5, top_p=0.8)
    full = sampling.sampling_logprobs(logits, torch.full((4,), 0.9), torch.full((4,), 5), torch.full((4,), 0.8))
    assert torch.equal(truncated, full.gather(-1, targets[:, None])[:, 0])
    # Where the token was kept, truncation only renormalizes: the logprob rises by -log(kept mass).
    kept = truncated > float("-inf")
    assert bool((truncated[kept] >= plain[kept]).all())


def test_batch_cache_decodes_like_separate_sequences():
    """Rows of different lengths joining and leaving a batch compute what each computes alone."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from svc_policy.kv import BatchCache, cache_keyword

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    steps = [[11, 12, 13, 14], [15, 16, 17, 18, 19, 20], [21, 22]]

    def alone(prompt, tokens):
        ids = torch.tensor([prompt + tokens])
        return model(input_ids=ids).logits[0, len(prompt) - 1 :]

    expected = [alone(p, s) for p, s in zip(prompts, steps)]
    cache_arg = cache_keyword(model)

    def prefill(prompt):
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        ids = torch.tensor([prompt])
        out = model(input_ids=ids, position_ids=torch.arange(len(prompt))[None], use_cache=True, **{cache_arg: cache})
        return [(layer.keys, layer.values) for layer in cache.layers], out.logits[0, -1]

    batch = BatchCache()
    rows: list[int] = []  # which sequence each row is
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    position = {0: 0, 1: 0, 2: 0}
    with torch.no_grad():
        for joining in (0, 1):  # sequences 0 and 1 start together, 2 joins after two steps
            kv, logits = prefill(prompts[joining])
            batch.add(kv, len(prompts[joining]), copies=1, spare=2)
            rows.append(joining)
            got[joining].append(logits)
        for step in range(7):
            if step == 2:
                kv, logits = prefill(prompts[2])
                batch.add(kv, len(prompts[2]), copies=1, spare=2)
                rows.append(2)
                got[2].append(logits)
            live = [r for r, s in enumerate(rows) if position[s] < len(steps[s])]
            batch.keep(live)
            rows = [rows[r] for r in live]
            if not rows:
                break
            tokens = torch.tensor([[steps[s][position[s]]] for s in rows])
            out = model(input_ids=tokens, attention_mask=batch.attention_mask(extra=1),
                        position_ids=torch.tensor(batch.lengths)[:, None], use_cache=True,
                        **{cache_arg: batch.cache()})
            batch.advance()
            for r, s in enumerate(rows):
                position[s] += 1
                got[s].append(out.logits[r, -1])
    for s in range(3):
        assert torch.allclose(torch.stack(got[s]), expected[s], atol=1e-5), s


def test_stop_strings_and_completion_text():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from svc_policy.text import StopStrings, completion_text

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = tokenizer("int main() { return 0; } // done", add_special_tokens=False)["input_ids"]
    stops = StopStrings(tokenizer, ["}"])
    first = next(t for t in range(1, len(ids) + 1) if stops.hit(ids[:t]))
    assert tokenizer.decode(ids[:first]).endswith("}")
    assert completion_text(tokenizer, ids, ["}"], ()) == "int main() { return 0; }"
    assert completion_text(tokenizer, ids, [], ids[-1:]) == "int main() { return 0; } // don"  # end id left out


def test_tokenizer_fingerprint_is_the_tokenization_not_the_files(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from leap.tokenization import tokenizer_fingerprint

    def make(words):
        backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")

    one = make(["[UNK]", "a", "b"])
    one.save_pretrained(tmp_path / "one")
    one.save_pretrained(tmp_path / "copy")
    (tmp_path / "copy" / "tokenizer_config.json").write_text(
        (tmp_path / "copy" / "tokenizer_config.json").read_text().replace("}", ', "model_max_length": 77}', 1))
    loaded = [AutoTokenizer.from_pretrained(tmp_path / name) for name in ("one", "copy")]
    assert tokenizer_fingerprint(loaded[0]) == tokenizer_fingerprint(loaded[1]) == tokenizer_fingerprint(one)
    assert tokenizer_fingerprint(make(["[UNK]", "a", "c"])) != tokenizer_fingerprint(one)
    extra = make(["[UNK]", "a", "b"])
    extra.add_special_tokens({"eos_token": "<|end|>"})
    assert tokenizer_fingerprint(extra) != tokenizer_fingerprint(one)
