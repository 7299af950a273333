"""The built-in prompt set: templates x topics over the kinds of requests a chat model serves
(writing, role play, reasoning, maths, coding, extraction, science, humanities, translation,
summarising, questions, lists, stories). Deterministic for a seed; never the Spec-Bench prompts.

Summarising and extraction prompts need passages; `passage_prompts` builds them from the target's
own earlier answers, so the draft also learns to copy from its context. `real_text_prompts` asks
terse requests (as real traffic does) about real prose: the documentation pages that ship with
Python (`pydoc_data`), and sentences of the target's answers to translate; `back_translation_
prompts` then asks for those translations back in English. `request_list_prompts` asks the target
to list requests users send (its own sampled lists, parsed by `listed_requests`), so the last
stage answers requests in words no template has."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prompt:
    category: str
    text: str
    # True/False for a prompt of a file with its own held-out split (faser.distill.prompt_files);
    # None for the built-in ones, of whose greedy answers every tenth is held out instead
    held_out: bool | None = None


TOPICS = (
    "renewable energy", "the history of the printing press", "learning a second language",
    "urban gardening", "the human immune system", "black holes", "remote work", "coffee",
    "the French Revolution", "machine learning", "climate change", "the Roman Empire",
    "healthy sleep", "electric cars", "volcanoes", "the stock market", "photosynthesis",
    "ancient Egypt", "public libraries", "space exploration", "honey bees", "social media",
    "the water cycle", "chess", "jazz music", "the Internet", "recycling", "marathon training",
    "the Renaissance", "quantum computing", "ocean currents", "vaccines", "minimalism",
    "the Industrial Revolution", "rainforests", "cryptography", "volunteering", "bread baking",
    "the Moon landing", "time management", "earthquakes", "democracy", "3D printing",
    "the Silk Road", "mental health", "solar panels", "dinosaurs", "public speaking",
)

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese")

SENTENCES = (
    "The weather is lovely today, so we are going to the park.",
    "Could you tell me where the nearest train station is?",
    "I have been reading a fascinating book about the history of science.",
    "Our meeting has been moved to Thursday afternoon.",
    "She bought fresh vegetables at the market this morning.",
    "Learning never exhausts the mind.",
    "The museum opens at nine and closes at five.",
    "Please remember to turn off the lights when you leave.",
)

CODING_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "merges two sorted lists", "counts the words in a text", "removes duplicates from a list",
    "finds the longest common prefix of a list of strings", "implements binary search",
    "converts Celsius to Fahrenheit", "checks whether a string is a palindrome",
    "computes the factorial of a number", "flattens a nested list", "sorts a list with quicksort",
    "parses a CSV line into fields", "finds the maximum subarray sum",
    "validates an email address with a regular expression", "computes the GCD of two numbers",
    "transposes a matrix", "counts the vowels in a string", "implements a stack class",
)

ROLES = (
    "a tour guide in Rome", "a personal fitness coach", "a detective in 1920s London",
    "a chef in a busy restaurant", "a customer support agent", "a medieval knight",
    "a science teacher", "a travel agent", "a pirate captain", "a job interviewer",
)

CHARACTERS = (
    "a young inventor", "a lonely robot", "a curious fox", "an old lighthouse keeper",
    "a girl who can talk to birds", "a retired astronaut", "a lost dragon", "two best friends",
)

EVENTS = (
    "finds a mysterious map", "must save their village", "wakes up in the future",
    "enters a baking contest", "discovers a hidden door", "gets lost in a big city",
)

TOPIC_TEMPLATES: dict[str, tuple[str, ...]] = {
    "writing": (
        "Write a short blog post about {topic}.",
        "Compose a persuasive essay on why people should care about {topic}.",
        "Write a poem about {topic}.",
        "Draft a professional email inviting colleagues to a talk about {topic}.",
        "Write a product description for a book about {topic}.",
    ),
    "qa": (
        "What is {topic}? Explain it in simple terms.",
        "What are the most common misconceptions about {topic}?",
        "Why is {topic} important?",
        "Give me a short introduction to {topic} for a beginner.",
    ),
    "stem": (
        "Explain the science behind {topic}.",
        "How does {topic} work? Describe it step by step.",
        "Describe the main challenges in {topic} and how engineers address them.",
    ),
    "humanities": (
        "Discuss the social impact of {topic}.",
        "How has {topic} changed over the last century?",
        "Compare two different perspectives on {topic}.",
    ),
    "lists": (
        "List five tips for someone interested in {topic}.",
        "Give me ten interesting facts about {topic}.",
        "What are the pros and cons of {topic}? Answer as a bulleted list.",
        "Create a study plan for learning about {topic}, as a numbered list.",
    ),
    "reasoning": (
        "Think step by step: what would happen if {topic} suddenly disappeared?",
        "Explain the cause and effect relationships involved in {topic}.",
    ),
}


def build_prompts(num_prompts: int, seed: int = 0) -> list[Prompt]:
    """`num_prompts` prompts, categories interleaved so that any prefix of the list is varied."""
    rng = random.Random(seed)
    pools = [_shuffled(pool, rng) for pool in _pools(rng).values()]
    prompts: list[Prompt] = []
    while len(prompts) < num_prompts and any(pools):
        for pool in pools:
            if pool and len(prompts) < num_prompts:
                prompts.append(pool.pop())
    return prompts


def passage_prompts(passages: list[str], seed: int = 0) -> list[Prompt]:
    """Summarising, extraction and question answering over given passages."""
    rng = random.Random(seed)
    templates = (
        ("summarization", "Summarize the following text in a few sentences.\n\n{p}"),
        ("summarization", "{p}\n\nWrite a one-paragraph summary of the text above."),
        ("extraction", "Extract the key facts from the following text as a bulleted list.\n\n{p}"),
        ("rag", "Read the passage and answer: what is its main point?\n\nPassage: {p}"),
        ("rewriting", "Rewrite the following text in a more formal tone.\n\n{p}"),
    )
    prompts = []
    for passage in passages:
        category, template = rng.choice(templates)
        prompts.append(Prompt(category, template.format(p=passage.strip())))
    return prompts


TRANSLATED_INTO = ("German", "French", "Spanish")


def real_text_prompts(
    sentences: list[str], seed: int = 0, passage_chars: int = 900
) -> list[Prompt]:
    """Terse requests over real prose: summarising and questions on pydoc's pages, and
    `sentences` (from the target's answers) to translate; categories interleaved."""
    rng = random.Random(seed)
    templates = (
        ("summarization", "Summarize: {p}"),
        ("summarization", "Summarize the following passage in two sentences.\n\n{p}"),
        ("rag", "{p}\n\nBased on the passage above, what is the main idea?"),
        ("extraction", "List the technical terms used in this text: {p}"),
    )
    passage_pool = [
        Prompt(category, template.format(p=passage))
        for passage in _doc_passages(passage_chars)
        for category, template in [rng.choice(templates)]
    ]
    languages = [rng.choice(TRANSLATED_INTO) for _ in sentences]
    translation_pool = [
        Prompt(f"translation:{language}", f"Translate English to {language}: {sentence}")
        for language, sentence in zip(languages, sentences, strict=True)
    ]
    pools = [_shuffled(passage_pool, rng), _shuffled(translation_pool, rng)]
    prompts: list[Prompt] = []
    while any(pools):
        for pool in pools:
            if pool:
                prompts.append(pool.pop())
    return prompts


def back_translation_prompts(translations: list[tuple[str, str]]) -> list[Prompt]:
    """(language, text in it) -> a request to translate the text into English."""
    return [
        Prompt("translation", f"Translate {language} to English: {text}")
        for language, text in translations
    ]


SUBJECTS = (
    "cooking", "travel in Europe", "personal finance", "gardening", "job interviews",
    "the history of Japan", "world geography", "physics", "chemistry", "biology",
    "programming in Python", "web development", "databases", "statistics", "algebra",
    "geometry", "nutrition", "fitness", "parenting", "pets", "movies", "music theory",
    "painting", "photography", "philosophy", "economics", "law", "medicine", "psychology",
    "astronomy", "literature", "poetry", "sports", "video games", "cars", "home repair",
    "starting a business", "marketing", "writing a novel", "learning languages",
    "ancient history", "modern history", "politics", "the environment", "weather",
    "computers", "smartphones", "relationships", "education", "careers",
)

REQUEST_LISTS = (
    "List 8 different questions people often ask about {s}.",
    "List 8 short trivia questions about {s}.",
    "List 8 requests a user might send to an AI assistant about {s}.",
    "List 8 tasks a person might ask an AI assistant to help with in {s}.",
    "List 8 homework questions a student might ask about {s}.",
)

_LIST_ITEM = re.compile(r"^\s*\d{1,2}[.)]\s+(.+)$")


def request_list_prompts() -> list[Prompt]:
    """Requests for lists of requests: every template over every subject and topic."""
    return [
        Prompt("request_list", template.format(s=subject))
        for subject in SUBJECTS + TOPICS
        for template in REQUEST_LISTS
    ]


def listed_requests(text: str) -> list[str]:
    """The numbered items of a list the target wrote that read as requests (4-40 words, no
    markup, not an echo of the asking prompt), in order, each once."""
    requests: dict[str, str] = {}  # lower-cased -> first spelling, in order
    for line in text.splitlines():
        match = _LIST_ITEM.match(line)
        if not match:
            continue
        item = match.group(1).strip().strip('"*').strip()
        words = item.split()
        if 4 <= len(words) <= 40 and not item.lower().startswith("list ") and "*" not in item:
            requests.setdefault(item.lower(), item)
    return list(requests.values())


def answer_prompts(requests: list[str], seed: int = 0) -> list[Prompt]:
    """Each distinct request once (first spelling kept), in a seeded order."""
    seen: dict[str, str] = {}
    for request in requests:
        seen.setdefault(request.lower(), request)
    prompts = [Prompt("listed", text) for text in seen.values()]
    random.Random(seed).shuffle(prompts)
    return prompts


def _doc_passages(chars: int) -> list[str]:
    """Paragraph-aligned passages of about `chars` characters from pydoc's topic pages."""
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        current = ""
        for paragraph in topics[name].split("\n\n"):
            paragraph = " ".join(paragraph.split())
            if len(paragraph) < 40:
                continue
            current = f"{current} {paragraph}".strip()
            if len(current) >= chars:
                passages.append(current[: 2 * chars])
                current = ""
    return passages


def _pools(rng: random.Random) -> dict[str, list[Prompt]]:
    pools: dict[str, list[Prompt]] = {}
    for category, templates in TOPIC_TEMPLATES.items():
        pools[category] = [
            Prompt(category, t.format(topic=topic)) for t in templates for topic in TOPICS
        ]
    pools["coding"] = [
        Prompt("coding", t.format(task=task))
        for task in CODING_TASKS
        for t in (
            "Write a Python function that {task}.",
            "Write a Python function that {task}, with a docstring and an example.",
            "Explain how to write a program that {task}, then show the code in Python.",
            "Write a JavaScript function that {task}.",
        )
    ]
    pools["math"] = [_math_prompt(rng) for _ in range(200)]
    pools["translation"] = [
        Prompt("translation", f"Translate into {lang}: {sentence}")
        for lang in LANGUAGES
        for sentence in SENTENCES
    ]
    pools["roleplay"] = [
        Prompt("roleplay", f"Pretend you are {role}. Tell me about {topic}.")
        for role in ROLES
        for topic in TOPICS[::4]
    ]
    pools["stories"] = [
        Prompt("stories", f"Tell a short story about {who} who {event}.")
        for who in CHARACTERS
        for event in EVENTS
    ]
    return pools


def _math_prompt(rng: random.Random) -> Prompt:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    templates = (
        f"What is {a} times {b}? Show your work.",
        f"Solve for x: {c}x + {a} = {b + a * c}. Explain each step.",
        f"A shop sells pencils at {c} dollars each. How much do {a} pencils cost?",
        f"A train travels at {a} km/h for {c} hours. How far does it go? Explain.",
        f"If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?",
        f"Tom has {a} apples and gives away {min(a, b)}. Then he buys {c} more. How many now?",
        f"What is {a}% of {b * 10}? Explain the calculation.",
        f"Find the sum of the first {c * 5} positive integers, step by step.",
    )
    return Prompt("math", rng.choice(templates))


def _shuffled(items: list[Prompt], rng: random.Random) -> list[Prompt]:
    items = list(items)
    rng.shuffle(items)
    return items
