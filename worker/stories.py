"""Deterministic children's stories in the TinyStories style, for tests, the demo and benchmarks.

`generate_stories(n, seed)` needs no data and no network. Story lengths follow TinyStories: a median of
about 150 words (~200 Gemma tokens) with a lognormal tail (a few short ones near 50 tokens, some past
600). Story i depends only on (seed, i), so a smaller `n` gives a prefix of a larger one.

    python -m worker.stories OUT.txt --n 2000 --seed 0
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from worker.data import TXT_SEPARATOR

MEDIAN_WORDS = 140
LENGTH_SIGMA = 0.5
MIN_WORDS = 30
MAX_WORDS = 900

GIRLS = (
    "Amy", "Lily", "Mia", "Sue", "Anna", "Lucy", "Emma", "Sara", "Zoe", "Ella", "Kim", "Rose", "Daisy",
    "Molly", "Ruby", "Nina", "Jenny", "Sophie", "Grace", "Hannah",
)  # fmt: skip
BOYS = (
    "Tim", "Ben", "Max", "Sam", "Tom", "Jack", "Leo", "Finn", "Joe", "Bob", "Timmy", "Jake", "Danny",
    "Oliver", "Henry", "Peter", "Noah", "Billy", "Luke", "Eli",
)  # fmt: skip
ANIMALS = (
    "dog", "cat", "bunny", "bird", "bear", "fox", "frog", "duck", "mouse", "owl", "puppy", "kitten",
    "squirrel", "turtle", "lion", "pig",
)  # fmt: skip
ANIMAL_NAMES = (
    "Spot", "Fluffy", "Pip", "Buddy", "Coco", "Max", "Bella", "Sunny", "Whiskers", "Tiny", "Rusty",
    "Pebble", "Honey", "Bubbles", "Ziggy", "Mittens",
)  # fmt: skip
CHILD_ADJECTIVES = ("little", "happy", "kind", "curious", "brave", "shy", "cheerful", "clever", "friendly")
ANIMAL_ADJECTIVES = ("little", "fluffy", "small", "playful", "soft", "curious", "happy", "brave")
HOMES = (
    "a small house", "a little blue house", "a big white house", "a cozy cottage", "a house with a red door",
    "a tall yellow house",
)  # fmt: skip
ANIMAL_HOMES = ("a big tree", "a warm hole", "a cozy nest", "a little barn", "a pond", "a hollow log")
PLACES = (
    "park", "forest", "beach", "garden", "lake", "hill", "farm", "meadow", "river", "zoo", "playground",
    "market", "library", "field", "backyard",
)  # fmt: skip
TOWNS = ("a small town", "a quiet village", "a big city", "a sunny valley", "a land far away")
HOBBIES = (
    "play outside", "draw pictures", "sing songs", "run and jump", "read books", "play with blocks",
    "look at the stars", "dance in the rain", "pick flowers", "build sandcastles", "ride a bike",
    "help in the kitchen", "play ball", "chase butterflies", "climb trees", "splash in puddles",
)  # fmt: skip
OBJECTS = (
    "ball", "kite", "box", "shell", "stone", "teddy bear", "hat", "toy car", "book", "key", "balloon",
    "cup", "flower", "leaf", "drum", "spoon", "boat", "doll", "map", "crayon", "feather", "ring",
)  # fmt: skip
OBJECT_ADJECTIVES = (
    "shiny", "red", "blue", "big", "small", "soft", "old", "new", "pretty", "yellow", "green", "sparkly",
    "round", "funny", "colorful", "tiny", "purple", "golden",
)  # fmt: skip
HAPPY = ("happy", "excited", "glad", "proud", "joyful", "surprised")
SAD = ("sad", "upset", "worried", "scared", "grumpy", "lonely")
HAZARDS = (
    "a deep puddle", "the river", "a thorny bush", "a big hole", "a muddy ditch", "the pond",
    "a pile of wet leaves", "the tall grass",
)  # fmt: skip
HELPERS = (
    ("Mom", "she"), ("Dad", "he"), ("Grandma", "she"), ("Grandpa", "he"), ("a kind old man", "he"),
    ("a wise owl", "she"), ("a tall giraffe", "she"), ("the friendly farmer", "he"),
)  # fmt: skip
TREATS = ("cookies", "apples", "cake", "ice cream", "sandwiches", "warm soup", "berries", "pancakes")
WEATHER = (
    "The sun was shining", "It was a warm day", "The sky was blue", "It was a windy day",
    "The birds were singing", "It was a cold morning", "A soft rain was falling",
)  # fmt: skip
LESSONS = (
    "sharing makes everyone happy", "it is good to help others", "being brave is not so hard",
    "friends are the best treasure", "it is important to be careful", "saying sorry can fix a lot",
    "being kind always feels good", "you should never give up", "listening to others is wise",
    "it is fun to try new things",
)  # fmt: skip
TRANSITIONS = ("The next day", "Later that day", "After a while", "The next morning", "One sunny afternoon")


@dataclass(frozen=True)
class _Character:
    name: str
    kind: str  # "girl", "boy" or an animal noun
    pronoun: str  # "he" or "she"
    adjective: str
    home: str

    @property
    def possessive(self) -> str:
        return "her" if self.pronoun == "she" else "his"

    @property
    def objective(self) -> str:
        return "her" if self.pronoun == "she" else "him"


def _character(rng: random.Random, avoid: str = "") -> _Character:
    while True:
        roll = rng.random()
        if roll < 0.4:
            who = _Character(
                rng.choice(GIRLS), "girl", "she", rng.choice(CHILD_ADJECTIVES), rng.choice(HOMES)
            )
        elif roll < 0.8:
            who = _Character(rng.choice(BOYS), "boy", "he", rng.choice(CHILD_ADJECTIVES), rng.choice(HOMES))
        else:
            who = _Character(
                rng.choice(ANIMAL_NAMES),
                rng.choice(ANIMALS),
                rng.choice(("he", "she")),
                rng.choice(ANIMAL_ADJECTIVES),
                rng.choice(ANIMAL_HOMES),
            )
        if who.name != avoid:
            return who


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Story:
    """One story being written: its cast, its current thing and place, and the sentences so far."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.hero = _character(rng)
        self.friend = _character(rng, avoid=self.hero.name)
        self.paragraphs: list[list[str]] = [[]]
        self.words = 0
        self.new_scene()

    def new_scene(self) -> None:
        self.place = self.rng.choice(PLACES)
        self.thing = self.rng.choice(OBJECTS)
        self.thing_adj = self.rng.choice(OBJECT_ADJECTIVES)

    def _values(self) -> dict[str, str]:
        hero, friend = self.hero, self.friend
        helper, helper_pronoun = self.rng.choice(HELPERS)
        values = {
            "name": hero.name,
            "he": hero.pronoun,
            "his": hero.possessive,
            "him": hero.objective,
            "kind": hero.kind,
            "adj": hero.adjective,
            "a_adj": _article(hero.adjective),
            "home": hero.home,
            "fname": friend.name,
            "fhe": friend.pronoun,
            "fhis": friend.possessive,
            "fkind": friend.kind,
            "fadj": friend.adjective,
            "a_fadj": _article(friend.adjective),
            "place": self.place,
            "thing": self.thing,
            "thing_adj": self.thing_adj,
            "a_thing_adj": _article(self.thing_adj),
            "town": self.rng.choice(TOWNS),
            "hobby": self.rng.choice(HOBBIES),
            "hobby2": self.rng.choice(HOBBIES),
            "happy": self.rng.choice(HAPPY),
            "sad": self.rng.choice(SAD),
            "hazard": self.rng.choice(HAZARDS),
            "helper": helper,
            "helper_he": helper_pronoun,
            "treat": self.rng.choice(TREATS),
            "weather": self.rng.choice(WEATHER),
            "lesson": self.rng.choice(LESSONS),
            "transition": self.rng.choice(TRANSITIONS),
        }
        for key in ("name", "he", "his", "fname", "fhe", "fhis", "helper", "helper_he"):
            values[key.capitalize()] = values[key][0].upper() + values[key][1:]
        return values

    def say(self, options: tuple[str, ...]) -> None:
        """Add one of `options`; one draw of the fillers serves all its sentences, so a helper stays put."""
        sentences = self.rng.choice(options).format(**self._values())
        self.paragraphs[-1].append(sentences)
        self.words += len(sentences.split())

    def new_paragraph(self) -> None:
        if self.paragraphs[-1]:
            self.paragraphs.append([])

    def text(self) -> str:
        return "\n\n".join(" ".join(paragraph) for paragraph in self.paragraphs if paragraph)


# Each beat of the plot is a choice of short passages; the story walks through the beats in order.
OPENINGS = (
    "Once upon a time, there was {a_adj} {adj} {kind} named {name}. {He} lived in {home} in {town}.",
    "Once upon a time, in {town}, there lived {a_adj} {adj} {kind} named {name}.",
    "There once was {a_adj} {adj} {kind} called {name}. {He} lived in {home}.",
    "One day, {a_adj} {adj} {kind} named {name} woke up early. {weather}.",
)
LIKES = (
    "{Name} loved to {hobby}.",
    "{Name} liked to {hobby} and {hobby2}.",
    "Every day, {name} would {hobby} with {his} friend {fname}, {a_fadj} {fadj} {fkind}.",
    "{His} best friend was {fname}, {a_fadj} {fadj} {fkind}. They liked to {hobby} together.",
)
OUTINGS = (
    "One day, {name} went to the {place}. {weather}.",
    "{transition}, {name} and {fname} went to the {place} to play.",
    "{weather}, so {name} asked {helper} if {he} could go to the {place}. "
    '"Yes, but be careful," said {helper}.',
    "{Name} put on {his} shoes and ran to the {place}. {He} was very {happy}.",
)
DISCOVERIES = (
    "At the {place}, {name} saw something {thing_adj} on the ground. "
    "It was {a_thing_adj} {thing_adj} {thing}!",
    "Under a bush, {name} found {a_thing_adj} {thing_adj} {thing}. {He} had never seen anything like it.",
    "Suddenly, {name} spotted {a_thing_adj} {thing_adj} {thing} near a big rock. "
    "{He} picked it up and looked at it closely.",
    "{Name} looked around and found {a_thing_adj} {thing_adj} {thing}. {He} felt {happy}.",
)
DIALOGUES = (
    '"Look, {fname}!" said {name}. "I found {a_thing_adj} {thing_adj} {thing}!" '
    '{Fname} smiled and said, "Wow, it is so pretty! Can I see it?"',
    '"What is that?" asked {fname}. "It is a {thing}," said {name}. "Do you want to play with it?" '
    '"Yes, please!" said {fname}.',
    '{Name} showed the {thing} to {fname}. "This is my {thing} now," {he} said. '
    '{Fname} looked {sad}. "Can we share it?" {fhe} asked.',
    '"Let\'s take the {thing} home," said {name}. "Good idea!" said {fname}. "We can show it to {helper}."',
)
PROBLEMS = (
    "But then, a strong wind blew the {thing} away. It landed in {hazard}. {Name} felt very {sad}.",
    "{Name} tried to throw the {thing} high in the air. Oops! The {thing} fell into {hazard}. "
    '"Oh no!" cried {name}.',
    "Suddenly, {name} tripped and the {thing} rolled into {hazard}. {He} did not know what to do. "
    "{He} started to cry.",
    "{Name} and {fname} both wanted the {thing}. They pulled and pulled until it slipped into {hazard}. "
    "Now nobody could play with it.",
)
RESCUES = (
    '{Fname} had an idea. "Let\'s work together," {fhe} said. '
    "{Fname} held {name}'s hand while {name} reached for the {thing}.",
    'Just then, {helper} came by. "Why are you {sad}?" {helper_he} asked. '
    "{Name} told {helper} about the {thing}. {Helper} smiled and helped get it back.",
    '{Name} took a deep breath. "I can do this," {he} said. '
    "{He} was careful and slow, and soon {he} had the {thing} in {his} hands again.",
    "{Name} and {fname} looked for a long stick. They used it to pull the {thing} out. "
    "It was a little dirty, but it was safe.",
)
RESOLUTIONS = (
    '"Thank you!" said {name}. {He} gave {fname} a big hug. They played with the {thing} all afternoon.',
    '{Name} was so {happy}. "I\'m sorry I did not share," {he} said to {fname}. '
    '"That\'s okay," said {fname}. "Let\'s play together."',
    "They went home and ate {treat}. {Name} told {helper} the whole story. "
    '"You were very brave," said {helper}.',
    "{Name} said thank you. {Fname} smiled at {him} and shared {fhis} {treat}.",
    "{Name} and {fname} laughed and cheered. They took turns with the {thing} until it was time to go home.",
)
REFLECTIONS = (
    "{Name} learned that {lesson}.",
    "That day, {name} learned that {lesson}. {He} would always remember it.",
    '"Today I learned that {lesson}," said {name}.',
)
ENDINGS = (
    "From that day on, {name} and {fname} were best friends.",
    "{Name} smiled. It had been the best day ever.",
    "That night, {name} went to sleep with a big smile.",
    "{Name} and {fname} played together until the sun went down.",
    "And they all lived happily ever after.",
    "{Name} knew that tomorrow would be another fun day.",
)
PLOT = (OUTINGS, DISCOVERIES, DIALOGUES, PROBLEMS, RESCUES, RESOLUTIONS, REFLECTIONS)
# Short stories skip the trouble-and-rescue arc rather than stopping halfway through it.
SHORT_PLOT = (OUTINGS, DISCOVERIES, DIALOGUES)
SHORT_STORY_WORDS = 90
NEW_PARAGRAPH_BEATS = (0, 3, 5)
# When the next beat is one of these (a rescue or its resolution), a problem is still open.
UNFINISHED_BEATS = (PLOT.index(RESCUES), PLOT.index(RESOLUTIONS))


def story_words(rng: random.Random) -> int:
    """A target length in words: lognormal around MEDIAN_WORDS, clipped to [MIN_WORDS, MAX_WORDS]."""
    words = rng.lognormvariate(math.log(MEDIAN_WORDS), LENGTH_SIGMA)
    return max(MIN_WORDS, min(MAX_WORDS, round(words)))


def generate_story(seed: int, index: int) -> str:
    """Story `index` of the stream for `seed`."""
    rng = random.Random(f"tputune-stories:{seed}:{index}")
    target = story_words(rng)
    story = _Story(rng)
    story.say(OPENINGS)
    story.say(LIKES)
    plot = SHORT_PLOT if target < SHORT_STORY_WORDS else PLOT
    beat = 0
    # The ending adds about ten words, so stop a little short of the target, but never mid-rescue.
    while story.words < target - 10 or beat % len(plot) in UNFINISHED_BEATS:
        step = beat % len(plot)
        if beat > 0 and step == 0:
            story.new_scene()
        if step in NEW_PARAGRAPH_BEATS:
            story.new_paragraph()
        story.say(plot[step])
        beat += 1
    story.say(ENDINGS)
    return story.text()


def generate_stories(n: int, seed: int) -> list[str]:
    """`n` stories, deterministic in `seed`."""
    return [generate_story(seed, index) for index in range(n)]


def write_txt(path: str | Path, stories: Iterable[str]) -> Path:
    """Write stories in the TinyStories .txt format: each followed by a `<|endoftext|>` line."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as handle:
        for story in stories:
            handle.write(f"{story}\n{TXT_SEPARATOR}\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write generated TinyStories-style stories to a .txt file.")
    parser.add_argument("out", type=Path, help="output .txt path")
    parser.add_argument("--n", type=int, default=2000, help="number of stories")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_txt(args.out, generate_stories(args.n, args.seed))


if __name__ == "__main__":
    main()
