"""Seeded synthetic long-context tasks (RULER-style), sized in real tokens, scored by exact match.

Every sample is a pure function of (task, length, index, seed): the same arguments give the same
prompt on any machine (``random.Random`` seeded with a string is stable across processes). The
filler is made of seeded noise sentences rather than one repeated line, so that pages differ from
each other and page selection has something to choose between.

Exact match: the output's items (digit runs, variable names, words) are compared with the expected
items as whole strings. Single-answer tasks score 1 when the first item equals the answer; tasks with
several answers score the fraction of expected items present (RULER's string_match_all). The long-output
codechain tasks score the share of the chain the output follows from its start (score_chain): each step's lookup
key is the number the model wrote the step before.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from typing import Callable

# ---- filler ------------------------------------------------------------------------------------

_SUBJECTS = ("The old farmer", "A young girl", "The tired baker", "My neighbour", "The quiet teacher", "A tall sailor",
             "The clever fox", "An old dog", "The small boy", "The painter", "A busy doctor", "The kind nurse",
             "The gardener", "A lonely poet", "The shopkeeper", "The fisherman", "Her brother", "The mayor",
             "A grey cat", "The travellers")
_VERBS = ("walked slowly to", "looked at", "talked about", "dreamed of", "painted", "cleaned", "visited",
          "ran past", "waited near", "sang a song about", "wrote a letter about", "forgot about", "laughed at",
          "remembered", "sat beside", "carried a basket to", "thought about", "read a book near")
_OBJECTS = ("the river", "the green hills", "the market", "the old bridge", "the garden", "the little house",
            "the forest", "the harbour", "the church", "the quiet lake", "the wooden fence", "the village square",
            "the red barn", "the mountains", "the library", "the railway station", "the orchard", "the school")
_ENDINGS = ("", "", "", " in the morning", " after lunch", " in the rain", " before sunset", " on Sunday",
            " with a smile", " for a long time", " once again", " in silence")

# Needle keys: none of these words occur in the filler.
KEY_WORDS = ("apple", "violin", "tiger", "compass", "lantern", "pepper", "falcon", "marble", "cactus", "helmet",
             "walnut", "rocket", "saddle", "turnip", "kettle", "dolphin", "anchor", "blanket", "cherry", "ladder",
             "magnet", "needle", "oyster", "parrot", "quilt", "raven", "spider", "teapot", "umbrella", "vulture",
             "wizard", "yogurt", "zebra", "biscuit", "candle", "dragon", "engine", "feather", "giraffe", "hammer",
             "igloo", "jacket", "koala", "lemon", "mirror", "noodle", "onion", "pillow", "rabbit", "statue")


def noise_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}."


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up word (2-3 syllables): the common-word task needs hundreds of words."""
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3)))


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


# ---- samples and scoring ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    index: int
    length: int  # target context length (prompt + generated tokens)
    text: str  # the rendered prompt, chat template included
    ids: tuple[int, ...]
    answers: tuple[str, ...]
    max_new_tokens: int
    depth: float | None  # relative position of the (first) needle in the filler

    def score(self, output: str) -> float:
        return TASKS[self.task].scorer(self.answers, output)


def score_first_number(answers: tuple[str, ...], output: str) -> float:
    found = re.findall(r"\d+", output)
    return float(bool(found) and found[0] == answers[0])


def _fraction(expected: tuple[str, ...], found: list[str]) -> float:
    got = set(found)
    return sum(a in got for a in expected) / len(expected)


def score_all_numbers(answers: tuple[str, ...], output: str) -> float:
    return _fraction(answers, re.findall(r"\d+", output))


def score_all_words(answers: tuple[str, ...], output: str) -> float:
    return _fraction(answers, re.findall(r"[A-Za-z]+", output))


def score_chain(answers: tuple[str, ...], output: str) -> float:
    """The share of the chain (codechain's answers) the output follows from its start: its numbers, with a
    number written twice in a row ('... is B. The code for B is ...') counted once, must begin with the answers in
    order; the first wrong or missing number ends the credit."""
    found = re.findall(r"\d+", output)
    steps = [n for i, n in enumerate(found) if i == 0 or n != found[i - 1]]
    good = 0
    for want, got in zip(answers, steps):
        if want != got:
            break
        good += 1
    return good / len(answers)


# ---- rendering and sizing --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Parts:
    instruction: str
    question: str
    answer_prefix: str


def render(tokenizer, parts: _Parts, body: str, template: str) -> str:
    """The prompt text. 'chat' wraps instruction+body+question in the chat template and starts the
    assistant's reply with the answer prefix (so a small model answers at once); 'plain' is a
    completion prompt with the same words."""
    user = f"{parts.instruction}\n\n{body}\n\n{parts.question}"
    if template == "chat":
        head = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        return head + parts.answer_prefix
    if template == "plain":
        return f"{user}\n{parts.answer_prefix}"
    raise ValueError(f"template must be 'chat' or 'plain', got {template!r}")


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def fit_units(tokenizer, parts: _Parts, units: list[str], inserts: Callable[[int], list[tuple[int, str]]],
              budget: int, template: str, sep: str = " ", tol: float = 0.03) -> tuple[str, list[int]]:
    """Use the largest prefix of ``units`` (filler pieces) whose rendered prompt has at most ``budget``
    tokens. ``inserts(n)`` gives (position, text) pairs placed among the first n units (the needles).
    Unit token counts are summed to guess n; the full prompt is then measured and n corrected."""
    def build(n: int) -> tuple[str, list[int]]:
        body = list(units[:n])
        for pos, text in sorted(inserts(n), key=lambda x: x[0], reverse=True):
            body.insert(pos, text)
        text = render(tokenizer, parts, sep.join(body), template)
        return text, _encode(tokenizer, text)

    base = len(build(0)[1])
    if base > budget:
        raise ValueError(f"the prompt without filler already has {base} tokens, more than {budget}")
    per_unit = [len(_encode(tokenizer, sep + u)) for u in units]
    n, total = 0, base
    while n < len(units) and total + per_unit[n] <= budget:
        total += per_unit[n]
        n += 1
    text, ids = build(n)
    while len(ids) > budget and n > 0:  # merges across unit boundaries may add a token here and there
        n -= max(1, (len(ids) - budget) // max(per_unit[n - 1], 1))
        text, ids = build(n)
    if n == len(units):
        raise ValueError("ran out of filler units; generate more")
    if len(ids) < budget * (1 - tol):
        raise ValueError(f"prompt of {len(ids)} tokens misses the target {budget} by more than {tol:.0%}")
    return text, ids


# ---- tasks -----------------------------------------------------------------------------------

def _depths(rng: random.Random, index: int, samples_hint: int = 10) -> float:
    # Stratified over ten bands so that any 10 consecutive samples cover the whole context.
    band = index % samples_hint
    return (band + rng.random()) / samples_hint


def _needle_haystack(tokenizer, rng, length, index, template, max_new, parts, needles, target_depth):
    """needles: texts; the first goes to target_depth, the others to random depths."""
    depths = [target_depth] + [rng.random() for _ in needles[1:]]
    units = [noise_sentence(rng) for _ in range(length // 6 + 64)]  # a noise sentence is >= 7 tokens

    def inserts(n):
        return [(round(d * n), t) for d, t in zip(depths, needles)]

    return fit_units(tokenizer, parts, units, inserts, length - max_new, template)


def make_passkey(tokenizer, rng, length, index, template):
    key = _digits(rng, 5)
    parts = _Parts("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                   "I will quiz you about the important information there.",
                   "What is the pass key number?", "The pass key number is")
    # "pass key number", not RULER's "pass key": at 4K+ tokens SmolLM2-135M answers "The pass key is"
    # with a description ("a small wooden box ...") even with dense attention.
    needle = f"The pass key number is {key}. Remember it. {key} is the pass key number."
    depth = _depths(rng, index)
    text, ids = _needle_haystack(tokenizer, rng, length, index, template, 7, parts, [needle], depth)
    return text, ids, (key,), 7, depth


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def make_multikey(tokenizer, rng, length, index, template, num_keys: int = 4):
    keys = rng.sample(KEY_WORDS, num_keys)
    values = [_digits(rng, 7) for _ in keys]
    parts = _Parts("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the numbers afterwards.",
                   f"What is the special magic number for {keys[0]} mentioned in the provided text?",
                   f"The special magic number for {keys[0]} mentioned in the provided text is")
    depth = _depths(rng, index)
    needles = [_magic(k, v) for k, v in zip(keys, values)]
    text, ids = _needle_haystack(tokenizer, rng, length, index, template, 10, parts, needles, depth)
    return text, ids, (values[0],), 10, depth


def make_multivalue(tokenizer, rng, length, index, template, num_values: int = 4):
    key = rng.choice(KEY_WORDS)
    values = []
    while len(values) < num_values:
        v = _digits(rng, 7)
        if v not in values:
            values.append(v)
    parts = _Parts("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the numbers afterwards.",
                   f"What are all the special magic numbers for {key} mentioned in the provided text?",
                   f"The special magic numbers for {key} mentioned in the provided text are")
    depth = _depths(rng, index)
    needles = [_magic(key, v) for v in values]
    text, ids = _needle_haystack(tokenizer, rng, length, index, template, 40, parts, needles, depth)
    return text, ids, tuple(values), 40, depth


def make_vartrack(tokenizer, rng, length, index, template, hops: int = 4):
    names = []
    while len(names) < hops + 1:
        n = _var_name(rng)
        if n not in names:
            names.append(n)
    value = _digits(rng, 5)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    parts = _Parts("Memorize and track the chain of variable assignments hidden in the following text.",
                   f"Question: Find all variables that are assigned the value {value} in the text above.",
                   f"Answer: According to the chain of variable assignments in the text above, {hops + 1} variables "
                   f"are assigned the value {value}, they are:")
    depth = _depths(rng, index)
    # The chain keeps its order: assignments go to increasing depths after the first.
    later = sorted(rng.uniform(depth, 1.0) for _ in chain[1:])
    units = [noise_sentence(rng) for _ in range(length // 6 + 64)]

    def inserts(n):
        return [(round(d * n), t) for d, t in zip([depth] + later, chain)]

    text, ids = fit_units(tokenizer, parts, units, inserts, length - 40, template)
    return text, ids, tuple(names), 40, depth


def chain_numbers(rng: random.Random, hops: int) -> list[str]:
    """hops + 1 distinct 5-digit numbers."""
    out: list[str] = []
    while len(out) < hops + 1:
        v = _digits(rng, 5)
        if v not in out:
            out.append(v)
    return out


def make_codechain(tokenizer, rng, length, index, template, hops: int = 4, distractors: int = 4):
    """A long-output task whose steps feed on the model's own output: 'The code for A is B.' needles hide in the
    filler, the first keyed by a word; the model writes the code for the word, then the code for that code, and so
    on, `hops` times after the first. Each lookup's key is the number the model itself wrote one step earlier (an
    induction copy from a different needle each step), so a step that goes wrong sends every later step down a
    wrong or missing chain. Distractor codes (other words, numbers outside the chain) sit among the needles.
    Answers: the chain, the word's code first."""
    word, *other = rng.sample(KEY_WORDS, 1 + distractors // 2)
    nums = chain_numbers(rng, hops + distractors * 2)
    chain, spare = nums[:hops + 1], nums[hops + 1:]
    codes = [f"The code for {a} is {b}." for a, b in zip(chain, chain[1:])]
    codes += [f"The code for {a} is {b}." for a, b in zip(other + spare[:distractors - len(other)], spare[::-1])]
    rng.shuffle(codes)
    needles = [f"The code for {word} is {chain[0]}."] + codes
    parts = _Parts("A list of codes is hidden inside a lot of irrelevant text. Find the codes and memorize them. "
                   "I will quiz you about them.",
                   f"Starting from {word}, follow the chain of codes: each number found is the key of the next "
                   f"step. Write each step as the sentence of the text that gives it.",
                   f"The code for {word} is")
    depth = _depths(rng, index)
    max_new = 16 * (hops + 1) + 8
    text, ids = _needle_haystack(tokenizer, rng, length, index, template, max_new, parts, needles, depth)
    return text, ids, tuple(chain), max_new, depth

def make_commonwords(tokenizer, rng, length, index, template, num_common: int = 10, freq_common: int = 30,
                     freq_rare: int = 3):
    vocab: list[str] = []
    while len(vocab) < length // 4:
        w = pseudo_word(rng)
        if w not in vocab:
            vocab.append(w)
    common, rare = vocab[:num_common], vocab[num_common:]
    # Rare words fill the remaining room; the list is shuffled once and then cut to fit, so the
    # common words are spread over the whole list at every size.
    words = common * freq_common + [w for w in rare for _ in range(freq_rare)]
    rng.shuffle(words)
    units = [f"{i + 1}. {w}" for i, w in enumerate(words)]
    parts = _Parts("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.",
                   f"Question: What are the {num_common} most common words in the above list?",
                   f"Answer: The top {num_common} words that appear most often in the list are:")
    text, ids = fit_units(tokenizer, parts, units, lambda n: [], length - 48, template)
    return text, ids, tuple(common), 48, None


@dataclasses.dataclass(frozen=True)
class Task:
    make: Callable
    scorer: Callable[[tuple[str, ...], str], float]


TASKS: dict[str, Task] = {
    "passkey": Task(make_passkey, score_first_number),
    "multikey": Task(make_multikey, score_first_number),
    "multivalue": Task(make_multivalue, score_all_numbers),
    "vartrack": Task(make_vartrack, score_all_words),
    "commonwords": Task(make_commonwords, score_all_words),
    "codechain": Task(make_codechain, score_chain),  # 5 numbers, ~90 tokens out: within a 128-token window
    # 17 numbers, ~280 tokens out: the model's first steps leave the window while it writes (for larger models)
    "codechain16": Task(functools.partial(make_codechain, hops=16, distractors=8), score_chain),
}


def make_sample(tokenizer, task: str, length: int, index: int, seed: int = 0, template: str = "chat") -> Sample:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    rng = random.Random(f"freekv-accuracy/{seed}/{task}/{length}/{index}")
    text, ids, answers, max_new, depth = TASKS[task].make(tokenizer, rng, length, index, template)
    return Sample(task, index, length, text, tuple(ids), answers, max_new, depth)


def make_samples(tokenizer, task: str, length: int, n: int, seed: int = 0, template: str = "chat") -> list[Sample]:
    return [make_sample(tokenizer, task, length, i, seed, template) for i in range(n)]
