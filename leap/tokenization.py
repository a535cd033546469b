"""Tokenizer identity: a fingerprint equal for two tokenizers that turn every text into the
same ids, so per-token scores of two models (student and teacher) can be compared."""

from __future__ import annotations

import hashlib
import json

# Parts of a tokenizer.json that decide which ids a text becomes. Padding, truncation and
# the decoder do not; the post-processor does (it adds BOS/EOS ids).
IDENTITY_KEYS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor")


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 (hex) of the vocabulary, merges, added and special tokens and the
    normalization and pre-tokenization rules of a Hugging Face tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        identity = {key: spec.get(key) for key in IDENTITY_KEYS}
    else:  # a slow (Python) tokenizer: its vocabulary is all there is to compare
        identity = {"vocab": sorted(tokenizer.get_vocab().items())}
    identity["special_tokens"] = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
