"""Varied prompts for the SmolLM2 correctness tests: chat-templated and raw, short to long."""

from __future__ import annotations

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Who wrote Pride and Prejudice?",
    "Give me a Python function that reverses a string.",
    "¿Cuál es el río más largo del mundo?",
    "Summarize the plot of Romeo and Juliet.",
]

RAW = [
    "The",
    "Once upon a time",
    "def fibonacci(n):\n",
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    "東京は日本の首都です。",
    "In 1969, the first humans landed on",
    "Water boils at",
]

_PARAGRAPH = (
    "The history of computing spans centuries, from the abacus and mechanical "
    "calculators of Pascal and Leibniz to Babbage's analytical engine, Turing's "
    "theoretical machines, and the electronic computers of the twentieth century. "
    "Each generation of hardware brought new programming ideas: assembly languages, "
    "compilers, operating systems, networks, and finally the web. "
)
_TOPICS = ["transistors", "memory", "storage", "graphics", "networking", "databases",
           "compilers", "security", "mobile devices", "machine learning", "robotics",
           "cloud services", "open source", "standards"]


def long_document() -> str:
    """A few thousand characters of varied prose: well over 1,000 tokens."""
    parts = [_PARAGRAPH]
    for i, topic in enumerate(_TOPICS):
        parts.append(
            f"Chapter {i + 1} covers {topic}. Engineers working on {topic} faced constraints "
            f"of cost, power and reliability, and solved them with clever designs that were "
            f"later adopted widely. By the end of the chapter the reader understands why "
            f"{topic} matter to every modern computer and how they evolved over decades. "
        )
    return "".join(parts * 2)


LONG_CHAT = "Read this and say in one sentence what it is about.\n\n" + long_document()
LONG_RAW = long_document() + "\nIn summary,"
