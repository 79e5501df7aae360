"""The fidelity prompt set: 216 short chat prompts of nine kinds (facts, explanations,
arithmetic, code, translation, verse, lists, advice, people), 24 of each, the kind of
thing people ask a small local model. `kvlm verify --against exact` and
benchmarks/bench_fidelity.py measure how often a model's fast path answers them as the
fp32 reference does (kvlm.engine.verify.compare)."""

from __future__ import annotations

_COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Kenya", "Norway", "Peru",
              "India", "Spain", "Italy", "Germany", "Mexico", "Chile", "Greece", "Turkey",
              "Poland", "Vietnam", "Australia", "Argentina", "Sweden", "Portugal", "Morocco",
              "Thailand"]  # fmt: skip
_CONCEPTS = ["a KV cache", "photosynthesis", "gravity", "a black hole", "inflation",
             "a neural network", "evolution", "an atom", "the water cycle", "democracy",
             "a vaccine", "entropy", "a prime number", "an algorithm", "plate tectonics",
             "the immune system", "a compiler", "climate change", "supply and demand",
             "a hash table", "magnetism", "DNA", "a recession", "the speed of light"]  # fmt: skip
_NUMBERS = [(12, 7), (9, 8), (15, 4), (23, 3), (6, 11), (14, 14), (7, 25), (19, 5),
            (31, 2), (8, 13), (16, 6), (27, 3)]  # fmt: skip
_TASKS = ["reverses a string", "checks whether a number is prime", "sums a list",
          "counts the vowels in a word", "returns the largest of three numbers",
          "computes a factorial", "merges two sorted lists", "removes duplicates from a list",
          "checks whether a word is a palindrome", "converts Celsius to Fahrenheit",
          "returns the n-th Fibonacci number", "flattens a nested list",
          "counts words in a sentence", "finds the average of a list",
          "sorts a list of names", "capitalizes every word", "checks for a leap year",
          "reads a file line by line", "returns the even numbers of a list",
          "computes the greatest common divisor", "swaps two variables",
          "counts the characters of a string", "squares every number in a list",
          "joins a list of words with commas"]  # fmt: skip
_PHRASES = ["good morning", "thank you", "where is the station", "I love books",
            "the weather is nice", "see you tomorrow", "how much does it cost",
            "my name is Anna"]  # fmt: skip
_LANGUAGES = ["Spanish", "French", "German"]
_THINGS = ["the sea", "autumn leaves", "a city at night", "the moon", "a mountain",
           "rain", "a cat", "the first snow", "a garden", "the desert", "a lighthouse",
           "morning coffee", "a river", "the stars", "a forest", "an old bridge", "spring",
           "the wind", "a train journey", "a library", "the sunrise", "a storm",
           "a quiet street", "the ocean floor"]  # fmt: skip
_CATEGORIES = ["prime numbers", "fruits", "planets", "colors", "programming languages",
               "European capitals", "musical instruments", "mammals", "vegetables",
               "sports", "chemical elements", "rivers", "birds", "board games", "metals",
               "flowers", "oceans", "famous painters", "kitchen tools", "trees",
               "dog breeds", "car brands", "continents", "card games"]  # fmt: skip
_ACTIVITIES = ["learning Python", "sleeping better", "saving money", "running a first 5k",
               "learning a language", "writing an essay", "cooking rice", "staying focused",
               "public speaking", "keeping a plant alive", "a job interview",
               "reading more books", "drinking more water", "learning the guitar",
               "organizing a desk", "making friends in a new city", "taking good photos",
               "studying for an exam", "writing clean code", "traveling light",
               "remembering names", "starting to meditate", "fixing a flat tire",
               "baking bread"]  # fmt: skip
_DEEDS = ["wrote Hamlet", "painted the Mona Lisa", "discovered penicillin",
          "invented the telephone", "wrote Don Quixote", "developed the theory of relativity",
          "was the first person on the moon", "composed the Four Seasons",
          "wrote Pride and Prejudice", "discovered gravity", "invented the light bulb",
          "painted The Starry Night", "wrote The Odyssey", "founded Microsoft",
          "wrote War and Peace", "discovered radium", "invented the printing press",
          "wrote 1984", "sculpted David", "proposed the theory of evolution",
          "wrote The Divine Comedy", "invented the World Wide Web",
          "composed the Moonlight Sonata", "wrote One Hundred Years of Solitude"]  # fmt: skip


def fidelity_prompts() -> list[str]:
    """The 216 prompts, kind by kind (each kind's 24 in a fixed order)."""
    arithmetic = [f"What is {a} times {b}?" for a, b in _NUMBERS]
    arithmetic += [f"What is {a} plus {b}?" for a, b in _NUMBERS]
    translations = [f"Translate '{p}' into {lang}." for lang in _LANGUAGES for p in _PHRASES]
    kinds = [
        [f"What is the capital of {c}?" for c in _COUNTRIES],
        [f"Explain {c} in one sentence." for c in _CONCEPTS],
        arithmetic,
        [f"Write a Python function that {t}." for t in _TASKS],
        translations,
        [f"Write a haiku about {t}." for t in _THINGS],
        [f"List three {c}." for c in _CATEGORIES],
        [f"Give me a tip for {a}." for a in _ACTIVITIES],
        [f"Who {d}?" for d in _DEEDS],
    ]
    assert all(len(k) == 24 for k in kinds)
    return [p for kind in kinds for p in kind]


KINDS = ("facts", "explanations", "arithmetic", "code", "translation", "verse", "lists",
         "advice", "people")  # fmt: skip
