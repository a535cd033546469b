"""`leap serve policy`: Policy inference: sampling with logprobs, scoring, versioned weight updates."""
