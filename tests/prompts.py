"""Short chat prompts of mixed lengths, shared by the continuous-batching and serving tests."""

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, with one sentence of explanation for each of them.",
    "What is 12 times 7?",
    "Explain in one sentence why the sky is blue.",
    "Name a color.",
    "Translate 'good morning' into Spanish, French, German and Italian, then say which one you find the most "
    "pleasant to pronounce and why.",
    "Give me a synonym of happy.",
]
