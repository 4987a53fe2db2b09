"""Prompt templates for the demo dataset: varied chat requests, drawn deterministically from a seed.

`build_prompts(n, seed)` returns `n` distinct user prompts mixing short factual questions,
explanations, lists, small code requests, rewriting, math word problems, comparisons, advice,
definitions, summaries and short creative requests. Prompt lengths range from a few words to a
short paragraph. The same (n, seed) always gives the same list, in the same order.
"""

from __future__ import annotations

import random

COUNTRIES = [
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "Italy",
    "Kenya",
    "Spain",
    "India",
    "Mexico",
    "Norway",
    "Australia",
    "Germany",
    "Peru",
    "Vietnam",
    "Greece",
    "Turkey",
    "Argentina",
    "Sweden",
    "Portugal",
]
ANIMALS = [
    "elephant",
    "octopus",
    "penguin",
    "honeybee",
    "dolphin",
    "owl",
    "cheetah",
    "frog",
    "whale",
    "ant",
    "bat",
    "camel",
    "crow",
    "salmon",
    "tortoise",
]
CONCEPTS = [
    "photosynthesis",
    "gravity",
    "inflation",
    "the water cycle",
    "democracy",
    "vaccines",
    "machine learning",
    "compound interest",
    "plate tectonics",
    "the immune system",
    "electricity",
    "recycling",
    "the internet",
    "black holes",
    "evolution",
    "climate change",
    "supply and demand",
    "a rainbow",
    "the seasons",
    "sleep",
    "memory",
    "friction",
    "a budget",
    "encryption",
    "the moon's phases",
    "magnetism",
    "volcanoes",
    "tides",
]
AUDIENCES = ["a child", "a beginner", "a high school student", "my grandmother", "a busy manager"]
LIST_THINGS = [
    "healthy breakfast ideas",
    "tips for better sleep",
    "ways to save money",
    "fruits rich in vitamin C",
    "indoor hobbies",
    "famous painters",
    "programming languages",
    "ways to reduce stress",
    "things to pack for a beach trip",
    "board games for families",
    "benefits of regular exercise",
    "houseplants that are easy to care for",
    "tips for studying effectively",
    "uses for baking soda",
    "planets in the solar system",
    "ways to be more productive",
    "classic novels",
    "musical instruments",
    "tips for a job interview",
    "ideas for a rainy day",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the factorial of n",
    "counts the vowels in a string",
    "finds the largest number in a list",
    "removes duplicates from a list",
    "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit",
    "returns the n-th Fibonacci number",
    "sums the even numbers in a list",
    "sorts a list of names alphabetically",
    "counts how often each word appears in a sentence",
    "merges two sorted lists",
    "returns the average of a list of numbers",
    "capitalizes every word in a sentence",
    "checks whether a year is a leap year",
    "flattens a list of lists",
    "computes the greatest common divisor of two numbers",
]
LANGS = ["Python", "JavaScript", "Python", "Python", "C", "Java"]
SENTENCES = [
    "hey can u send me the report asap thx",
    "The meeting got moved because lots of people couldn't come.",
    "I think that maybe we should possibly consider changing the plan.",
    "our product is good and people like it and it is cheap",
    "Due to the fact that it was raining, the game was cancelled.",
    "The dog ran fast and the dog was happy and the dog barked.",
    "we r closed tmrw sorry for any trouble",
    "It is important to note that the results were not very good at all.",
    "The new phone has a big screen and a long battery life.",
    "She said she would call back but she never did call back.",
]
STYLES = ["more formal", "more polite", "shorter", "more friendly", "clearer", "more professional"]
ITEMS = [
    ("apples", "apple"),
    ("notebooks", "notebook"),
    ("tickets", "ticket"),
    ("pens", "pen"),
    ("cupcakes", "cupcake"),
    ("books", "book"),
    ("shirts", "shirt"),
    ("plants", "plant"),
]
NAMES = ["Anna", "Ben", "Carlos", "Dina", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack"]
PAIRS = [
    ("cats", "dogs"),
    ("tea", "coffee"),
    ("trains", "planes"),
    ("books", "movies"),
    ("renting", "buying a home"),
    ("Python", "JavaScript"),
    ("summer", "winter"),
    ("running", "swimming"),
    ("email", "phone calls"),
    ("cities", "the countryside"),
    ("solar power", "wind power"),
    ("paper books", "e-readers"),
]
ADVICE = [
    "learn a new language",
    "start running",
    "keep a plant alive",
    "make new friends in a new city",
    "prepare for an exam",
    "organize my desk",
    "write a good cover letter",
    "cook rice",
    "stay focused while working from home",
    "start saving for a trip",
    "learn to play the guitar",
    "give a short speech",
    "drink more water",
    "wake up earlier",
]
WORDS = [
    "serendipity",
    "ephemeral",
    "algorithm",
    "empathy",
    "metaphor",
    "ecosystem",
    "bandwidth",
    "nostalgia",
    "catalyst",
    "latitude",
    "irony",
    "entropy",
    "photosynthesis",
    "mortgage",
]
TOPICS = [
    "the ocean",
    "autumn leaves",
    "a city at night",
    "a cup of coffee",
    "the first snow",
    "a lost key",
    "mountains",
    "a robot learning to paint",
    "a lighthouse",
    "the moon",
]
FORMS = ["a haiku", "a short poem", "a two-sentence story", "a limerick", "a short story opening"]
PARAGRAPHS = [
    "The library in our town opened in 1920. At first it had only a few hundred books, kept in a "
    "single room above the post office. Over the years, donations from local families helped it grow, "
    "and in 1975 it moved into its own building. Today it lends books, films and music, and it offers "
    "free classes for adults who want to learn computer skills.",
    "Bees are important pollinators. When they visit flowers to collect nectar, they carry pollen from "
    "one plant to another, which helps plants produce fruit and seeds. Many crops depend on bees, "
    "including apples, almonds and berries. In recent years, bee populations have declined because of "
    "habitat loss, pesticides and disease.",
    "Our team finished the website redesign two weeks late. The main delays came from changing "
    "requirements and a server migration that took longer than planned. Users have responded well to "
    "the new layout, and page load times dropped by about forty percent.",
    "Regular walking has many benefits. It strengthens the heart, improves mood and helps with sleep. "
    "Unlike many sports, it needs no equipment and can be done almost anywhere. Experts suggest about "
    "thirty minutes of brisk walking on most days of the week.",
    "The bakery on Main Street is changing its hours. Starting next Monday it will open at 6 a.m. "
    "instead of 7 a.m., and it will close at 3 p.m. on weekdays. On Saturdays the hours stay the same, "
    "and the shop will remain closed on Sundays.",
]
FACTS = [
    "What is the capital of {country}?",
    "What language is spoken in {country}?",
    "What is the largest planet in our solar system?",
    "How many continents are there?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "What do {animal}s eat?",
    "Where do {animal}s live?",
    "How long does a {animal} live?",
    "What is the tallest mountain in the world?",
    "How many days are in a leap year?",
    "What is the freezing point of water in Fahrenheit?",
    "Who painted the Mona Lisa?",
    "What is the currency of {country}?",
    "What is the speed of light?",
    "How many bones are in the human body?",
    "What gas do plants absorb from the air?",
    "What is the longest river in the world?",
]


def _fact(r: random.Random) -> str:
    return r.choice(FACTS).format(country=r.choice(COUNTRIES), animal=r.choice(ANIMALS))


def _explain(r: random.Random) -> str:
    c = r.choice(CONCEPTS)
    return r.choice(
        [
            f"Explain {c} in simple terms.",
            f"How would you explain {c} to {r.choice(AUDIENCES)}?",
            f"Why does {c} matter?",
            f"Can you give me a short explanation of {c}?",
            f"What is {c} and how does it work?",
        ]
    )


def _list(r: random.Random) -> str:
    n, things = r.randint(3, 7), r.choice(LIST_THINGS)
    return r.choice(
        [
            f"List {n} {things}.",
            f"Give me {n} {things}.",
            f"What are {n} {things}? Answer as a numbered list.",
        ]
    )


def _code(r: random.Random) -> str:
    lang, task = r.choice(LANGS), r.choice(CODE_TASKS)
    return r.choice(
        [
            f"Write a {lang} function that {task}.",
            f"Can you show me {lang} code that {task}?",
            f"Write a short {lang} function that {task}, and explain it briefly.",
        ]
    )


def _rewrite(r: random.Random) -> str:
    s, style = r.choice(SENTENCES), r.choice(STYLES)
    return r.choice(
        [
            f'Rewrite this sentence to be {style}: "{s}"',
            f"Make the following text {style}:\n\n{s}",
            f'Fix the grammar and make it {style}: "{s}"',
        ]
    )


def _math(r: random.Random) -> str:
    (items, item), name = r.choice(ITEMS), r.choice(NAMES)
    a, b, p = r.randint(2, 15), r.randint(2, 9), r.randint(2, 12)
    return r.choice(
        [
            f"{name} buys {a} {items} at ${p} each. How much does {name} pay in total?",
            f"{name} has {a + b} {items} and gives away {b}. How many {items} are left?",
            f"A box holds {b} {items}. How many boxes are needed for {a * b} {items}?",
            f"A train travels {a * 10} km in {b} hours. What is its average speed?",
            f"{name} saves ${p} every week. How much will {name} have after {a} weeks?",
            f"If one {item} costs ${p} and {name} has ${p * a + b}, how many {items} can {name} buy, "
            f"and how much money is left?",
            f"What is {a * 7} plus {b * 13}?",
            f"What is {a} times {p * 3}?",
            f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        ]
    )


def _compare(r: random.Random) -> str:
    x, y = r.choice(PAIRS)
    return r.choice(
        [
            f"What are the differences between {x} and {y}?",
            f"Compare {x} and {y} briefly.",
            f"Which is better, {x} or {y}? Give pros and cons.",
        ]
    )


def _advice(r: random.Random) -> str:
    a = r.choice(ADVICE)
    return r.choice(
        [
            f"How can I {a}?",
            f"Give me some tips to {a}.",
            f"What is the best way to {a}?",
            f"I want to {a}. Where should I start?",
        ]
    )


def _define(r: random.Random) -> str:
    w = r.choice(WORDS)
    return r.choice(
        [
            f"What does the word '{w}' mean?",
            f"Define {w} and use it in a sentence.",
            f"Give a simple definition of {w}.",
        ]
    )


def _summarize(r: random.Random) -> str:
    p = r.choice(PARAGRAPHS)
    return r.choice(
        [
            f"Summarize this paragraph in one sentence:\n\n{p}",
            f"What is the main idea of the following text?\n\n{p}",
            f"Write three bullet points that capture this text:\n\n{p}",
        ]
    )


def _creative(r: random.Random) -> str:
    return f"Write {r.choice(FORMS)} about {r.choice(TOPICS)}."


# (kind, weight): short answers and long answers both well represented.
KINDS = [
    (_fact, 4),
    (_explain, 3),
    (_list, 3),
    (_code, 3),
    (_rewrite, 2),
    (_math, 4),
    (_compare, 2),
    (_advice, 2),
    (_define, 2),
    (_summarize, 2),
    (_creative, 2),
]


def build_prompts(n: int = 256, seed: int = 0) -> list[str]:
    """`n` distinct user prompts drawn from the templates with `random.Random(seed)`."""
    r = random.Random(seed)
    makers = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    seen: set[str] = set()
    out: list[str] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"the templates cannot produce {n} distinct prompts")
        p = r.choices(makers, weights)[0](r)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out
